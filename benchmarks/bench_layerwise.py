"""Layer-wise distributed Muon vs a replicated baseline, on one model shape.

    torchrun --nproc_per_node=2 benchmarks/bench_layerwise.py --config 1b

Muon on the blocks' 2-D weights, AdamW on the rest; bf16 autocast over fp32
parameters (the model stays replicated: layer-wise optimizers need no fully_shard).
Systems, in one run on the same model and data:
  replicated        DDP all-reduces the gradients; every rank runs Muon on every matrix
  layerwise_sync    each matrix has one owner (Newton-Schulz cost balanced); the
                    gradients are reduce-scattered (reduce_scatter_v), the owners step,
                    and step() all-gathers the parameters (all_gather_v) before it returns
  layerwise_overlap the same, but step() returns after launching the first bucket's
                    gather; forward pre-hooks finish each bucket and launch the next
Each timed iteration ends only when everything it launched has finished, including
the all-gather-v that layerwise_overlap's step() leaves running on its side stream.
Reports, per iteration the slowest rank, the median full step time and the median
optimizer phase (from the step() call until its work, that gather included, is done),
tokens/s/GPU, peak memory; writes layerwise.json (every iteration's times) and
layerwise.md under --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer, newton_schulz_cost
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import init_benchmark_process, run_meta  # noqa: E402

import shapes  # noqa: E402

CONFIGS = {"1b": shapes.LLAMA_1_3B, "tiny": shapes.TINY}  # benchmarks/shapes.py
SYSTEMS = ("replicated", "layerwise_sync", "layerwise_overlap")


def muon_and_adamw(named_params):
    """Muon for the blocks' 2-D weights, AdamW for embeddings, head and norms."""
    muon = [p for n, p in named_params if p.dim() == 2 and n.startswith("blocks.")]
    muon_ids = {id(p) for p in muon}
    rest = [p for _, p in named_params if id(p) not in muon_ids]
    opts = []
    if muon:
        opts.append(torch.optim.Muon(muon, lr=0.02, weight_decay=0.01))
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=1e-4, weight_decay=0.1))
    return opts


def run_one(system: str, name: str, device: torch.device, args) -> dict:
    vocab, d, layers, heads, ffn, mb, seq = CONFIGS[name]
    cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn, max_seq_len=seq)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device(device):  # GPU initialisation: a 1B model takes minutes on one CPU thread
        model = LlamaModel(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    if system == "replicated":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opts = muon_and_adamw(list(model.named_parameters()))
        step_fn = lambda: [o.step() for o in opts]  # noqa: E731
        zero_fn = lambda: [o.zero_grad(set_to_none=True) for o in opts]  # noqa: E731
    else:
        wrapped = model
        lopt = LayerwiseDistributedOptimizer(
            model, lambda owned: muon_and_adamw([(names[id(p)], p) for p in owned]),
            overlap_param_gather=system == "layerwise_overlap", cost_fn=newton_schulz_cost)
        step_fn, zero_fn = lopt.step, lopt.zero_grad
    autocast = device.type == "cuda"
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, vocab, (mb, seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1], data[:, 1:]

    def now():
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(a, b):
        return a.elapsed_time(b) / 1e3 if device.type == "cuda" else b - a

    step_times, opt_times = [], []
    for step in range(args.warmup + args.steps):
        t0 = now()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = wrapped(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        t1 = now()
        step_fn()
        # Stop the clock only once everything step() launched has finished. layerwise_overlap's
        # step() returns while the first bucket's all-gather-v still runs on the optimizer's
        # side stream; synchronize() waits for every stream, that one included, so the event
        # recorded after it is later than the gather's completion (the few microseconds of host
        # latency in between are counted too). The other buckets' gathers are finished by
        # forward pre-hooks, inside the next iteration's clock.
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = now()
        zero_fn()
        if step >= args.warmup:
            step_times.append(elapsed(t0, t2))
            opt_times.append(elapsed(t1, t2))
    # Per iteration the slowest rank decides (element-wise MAX over ranks), then the median.
    slowest = torch.tensor([step_times, opt_times], device=device, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_times, opt_times = slowest.tolist()
    peak = torch.tensor([torch.cuda.max_memory_allocated() if device.type == "cuda" else 0.0],
                        device=device, dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s, opt_s = statistics.median(step_times), statistics.median(opt_times)
    result = {"system": system, "config": name, "step_s": step_s, "opt_phase_s": opt_s,
              "step_spread_s": [min(step_times), max(step_times)],
              "tokens_per_s_per_gpu": mb * seq / step_s, "peak_mem_gib": peak.item() / 2**30,
              "final_loss": loss.item(), "step_times_s": step_times, "opt_phase_times_s": opt_times}
    wrapped = model = logits = loss = step_fn = zero_fn = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="1b", choices=sorted(CONFIGS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=10, help="timed iterations")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    device = init_benchmark_process(args.device, standalone_port=29562)
    results = []
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")
        r = run_one(system, args.config, device, args)
        results.append(r)
        if dist.get_rank() == 0:
            print(f"{system:>18}: step {r['step_s'] * 1e3:8.1f} ms  optimizer phase {r['opt_phase_s'] * 1e3:8.1f} ms  "
                  f"{r['tokens_per_s_per_gpu']:>9,.0f} tok/s/GPU  peak {r['peak_mem_gib']:.2f} GiB", flush=True)
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(run_meta(device), config=args.config, steps=args.steps, warmup=args.warmup,
                    timing="per iteration the slowest rank (all-reduce MAX), clock stopped after "
                           "torch.cuda.synchronize(); step_s / opt_phase_s = medians")
        (out / "layerwise.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        base = results[0]["step_s"] if results[0]["system"] == "replicated" else None
        lines = ["| system | step ms | optimizer phase ms | tokens/s/GPU | peak GiB | step vs replicated |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for r in results:
            ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
            lines.append(f"| {r['system']} | {r['step_s'] * 1e3:.1f} | {r['opt_phase_s'] * 1e3:.1f} | "
                         f"{r['tokens_per_s_per_gpu']:,.0f} | {r['peak_mem_gib']:.2f} | {ratio} |")
        (out / "layerwise.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
