"""estimate_memory against the measured CUDA allocator peak of a training step.

For each bench config, strategy and precision: the estimate from a meta-device build,
then the same model built on the meta device, sharded (fully_shard_model, one unit per
block), materialized on the GPU and trained a few fused-AdamW steps; the allocator's peak
over the last step (above what was allocated before the model) is compared with the
estimate's total. The estimate leaves activations out, so the micro-batch is one
sequence of 128 tokens: what activations remain in the measured peak is small, and a
ratio a little under 1 is what a right estimate gives.

Run with torchrun (world = GPUs); writes one JSON object per line to stdout and --out.
    torchrun --nproc_per_node=1 benchmarks/estimate_check.py --configs 1b_comm_bound,small_many
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import CONFIGS  # noqa: E402


def measure(name: str, strategy: str, bf16: bool, steps: int = 3) -> dict:
    vocab, d, layers, heads, ffn, _, _ = CONFIGS[name]
    cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn)
    # Activations are kept small on purpose (one sequence of 128 tokens): the estimate
    # excludes them, and what remains of them is measured and reported.
    micro, seq = 1, 128
    with torch.device("meta"):
        meta = LlamaModel(cfg)
    block = type(meta.blocks[0])
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    est = mfsdp.estimate_memory(meta, dist.get_world_size(), unit_modules=[block], sharding_strategy=strategy,
                                mp_policy=mp, optimizer="adamw")
    del meta
    device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()  # the previous measurement's model (hooks hold reference cycles)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with torch.device("meta"):
        model = LlamaModel(cfg)
    mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(data_parallel_sharding_strategy=strategy, bf16=bf16,
                                                    grad_reduce_in_fp32=bf16), fsdp_unit_modules=[block])
    mfsdp.materialize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (micro, seq), device=device)
    for step in range(steps):
        if step == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model.loss(tokens, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak > 0, f"peak {peak} below the baseline: memory of an earlier measurement was freed during this one"
    out = {"config": name, "strategy": strategy, "bf16": bf16, "world": dist.get_world_size(),
           "micro_batch": micro, "seq": seq, "estimate_bytes": est.total, "measured_peak_bytes": peak,
           "ratio_estimate_over_measured": est.total / peak,
           "components": {k: getattr(est, k) for k in ("params", "grads", "optimizer_state", "gathered_params",
                                                        "reduction_buffers")}}
    del model, opt, tokens
    gc.collect()
    torch.cuda.empty_cache()
    out["left_allocated_bytes"] = torch.cuda.memory_allocated() - base
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1b_comm_bound,small_many")
    p.add_argument("--strategies", default="optim_grads_params,optim_grads,optim")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = []
    for name in args.configs.split(","):
        for strategy in args.strategies.split(","):
            for bf16 in (False, True):
                row = measure(name, strategy, bf16)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(json.dumps(row), flush=True)
    if dist.get_rank() == 0 and args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
