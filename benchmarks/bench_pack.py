"""How fast a unit's gradients are packed for the reduce-scatter: our pack_into_flat (one
fused launch: bf16 gradients cast into the fp32 flat buffer, its padding zero-filled)
against what torch does for the same bytes: a copy_ per gradient into views of the buffer,
and FSDP2's torch._chunk_cat (its reduce-scatter input). Times are CUDA events around
--iters calls, median of --repeats; bandwidth counts bytes read plus bytes written.

    python benchmarks/bench_pack.py --config 13b --out $OUT/pack.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from run_meta import run_meta  # noqa: E402

from megatron_fsdp_ext import _C  # noqa: E402

CONFIGS = {"13b": shapes.LLAMA_13B, "1b": shapes.LLAMA_1_3B, "small_many": shapes.SMALL_MANY}


def block_shapes(shape) -> list[tuple[int, ...]]:
    """One Llama block's parameters (attention, SwiGLU MLP, two norms)."""
    d, ffn = shape.d_model, shape.ffn
    return [(d,), (d, d), (d, d), (d, d), (d, d), (d,), (ffn, d), (ffn, d), (d, ffn)]


def timed(fn, iters: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="13b", choices=sorted(CONFIGS))
    p.add_argument("--world", type=int, default=4, help="ranks the layout pads for (its segments)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pack.py measures CUDA kernels: no GPU here")
    dev = torch.device("cuda", 0)
    numels = [torch.Size(s).numel() for s in block_shapes(CONFIGS[args.config])]
    layout = _C.FlatLayout.even(numels, args.world, 16)
    offsets = list(layout.offsets)
    total = layout.total_numel
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in block_shapes(CONFIGS[args.config])]
    flat = torch.empty(total, device=dev, dtype=torch.float32)
    read = sum(g.numel() * 2 for g in grads)
    written = total * 4

    def ours():
        _C.pack_into_flat(flat, grads, offsets, False, True)

    views = [flat[o: o + g.numel()] for g, o in zip(grads, offsets)]

    def copies():
        for v, g in zip(views, grads):
            v.copy_(g.view(-1))

    # FSDP2's reduce-scatter input: each gradient's rows split into world chunks and
    # concatenated chunk-major, cast to the reduce dtype on the way.
    chunked = torch.empty(args.world, sum((g.numel() + args.world - 1) // args.world for g in grads),
                          device=dev, dtype=torch.float32)

    def chunk_cat():
        torch._chunk_cat(grads, dim=0, num_chunks=args.world, out=chunked)

    ours()
    expected = torch.zeros(total, device=dev)
    for g, o in zip(grads, offsets):
        expected[o: o + g.numel()] = g.float().view(-1)
    if not torch.equal(flat, expected):
        raise SystemExit("pack_into_flat disagrees with the reference copy")
    rows = []
    for name, fn, nbytes in (("pack_into_flat", ours, read + written), ("copy_ per gradient", copies, read + written),
                             ("torch._chunk_cat (FSDP2)", chunk_cat, read + chunked.numel() * 4)):
        fn()
        times = timed(fn, args.iters, args.repeats)
        ms = statistics.median(times)
        rows.append({"kernel": name, "ms": ms, "ms_min": min(times), "ms_max": max(times), "bytes": nbytes,
                     "gb_per_s": nbytes / ms / 1e6})
        print(f"{name:26s} {ms:8.3f} ms ({min(times):.3f}-{max(times):.3f})  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    meta = dict(run_meta(dev), command=" ".join(["python", *sys.argv]))
    result = {"meta": meta,
              "config": args.config, "world": args.world, "params": sum(numels), "flat_numel": total, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
