"""Time (and host or GPU memory) of save_checkpoint and load_checkpoint.

    torchrun --nproc_per_node=2 benchmarks/bench_checkpoint.py --layers 8 --dim 512 --repeats 3 \\
        --out benchmarks/data/checkpoint_cpu.json

A Llama model (one unit per block, plus the root) trained one AdamW step, then saved and
loaded --repeats times into a fresh directory under --dir each time; every rank is timed
from a barrier to a barrier, so the clock covers all ranks' work. Reports the median and
the spread (min, max) of each, the checkpoint's bytes on disk, and on CUDA the peak of
allocated GPU memory above the trained model's during each call (the state dicts the
save gathers, the targets the load reads into). Run it at two commits to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import init_benchmark_process, run_meta  # noqa: E402


def _build(args, device, seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=args.vocab, d_model=args.dim, n_layers=args.layers, n_heads=max(1, args.dim // 64),
                      ffn_hidden=4 * args.dim)
    model = LlamaModel(cfg).to(device)
    for block in model.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (2, 64), device=device)
    model.loss(tokens, tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _timed(fn, device) -> tuple:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    extra = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return seconds, extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = init_benchmark_process(args.device, 29561)
    rank = dist.get_rank()
    root = args.dir or (tempfile.mkdtemp(prefix="mfsdp_ckpt_bench_") if rank == 0 else None)
    shared = [root]
    dist.broadcast_object_list(shared)
    root = shared[0]
    model, opt = _build(args, device, 0)
    fresh, fresh_opt = _build(args, device, 1)
    saves, loads, save_mem, load_mem, nbytes = [], [], [], [], 0
    for i in range(args.repeats):
        path = os.path.join(root, f"ckpt_{i}")
        t, m = _timed(lambda: mfsdp.save_checkpoint(path, model, opt), device)
        saves.append(t)
        save_mem.append(m)
        t, m = _timed(lambda: mfsdp.load_checkpoint(path, fresh, fresh_opt), device)
        loads.append(t)
        load_mem.append(m)
        nbytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    params = sum(p.numel() for p in model.parameters())

    def summary(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}

    result = {
        "meta": run_meta(device), "args": vars(args), "world": dist.get_world_size(),
        "model_params_sharded_local": params, "checkpoint_bytes": nbytes,
        "save_s": summary(saves), "load_s": summary(loads),
        "save_extra_gpu_bytes": save_mem, "load_extra_gpu_bytes": load_mem,
    }
    if rank == 0:
        print(json.dumps({k: result[k] for k in ("world", "checkpoint_bytes", "save_s", "load_s")}, indent=1))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
