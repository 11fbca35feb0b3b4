"""A step's peak of allocated CPU memory, ours against FSDP2, on Gloo: no GPU needed.

torch.profiler with profile_memory=True sees every allocation and free of torch's CPU
allocator, with its address. The profile starts before the model is built, so the running
sum of those events is the process's allocated bytes (everything torch allocated since),
and its maximum inside the last step's record_function scope is that step's peak. The
model's peak is the root unit's reduction (a large embedding and output layer, a tiny
batch), where the order of freeing the gathered parameters and packing the gradients
shows. Gloo's reduce-scatter keeps a copy of its input until its work object is
destroyed, so some runs end a step holding more: run it several times.

    torchrun --nproc_per_node=2 benchmarks/cpu_peak.py --system mfsdp [--bf16] [--out f.json]
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function


class RootHeavy(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(blocks)])
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h).float().logsumexp(-1).mean()


def shard(model: RootHeavy, system: str, bf16: bool) -> None:
    if system == "mfsdp":
        import megatron_fsdp_ext as mfsdp

        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        shard_fn = mfsdp.fully_shard
    elif system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        shard_fn = fully_shard
    else:
        raise ValueError(f"--system must be mfsdp or fsdp2, got {system!r}")
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for block in model.blocks:
        shard_fn(block, **kwargs)
    shard_fn(model, **kwargs)


def allocated_timeline(prof):
    """(time ns, allocated bytes) after each CPU allocator event, in order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    total, out = 0, []
    for t, nbytes in events:
        total += nbytes
        out.append((t, total))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = RootHeavy(args.vocab, args.dim, args.blocks)
        params = sum(p.numel() for p in model.parameters())
        shard(model, args.system, args.bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, args.vocab, (1, 16))
        for step in range(args.steps):
            with record_function(f"cpu_peak::step{step}"):
                model(tokens).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    last = next(e for e in prof.profiler.kineto_results.events() if e.name() == f"cpu_peak::step{args.steps - 1}")
    timeline = allocated_timeline(prof)
    inside = [b for t, b in timeline if last.start_ns() <= t <= last.end_ns()]
    row = {"system": args.system, "bf16": args.bf16, "world": dist.get_world_size(), "rank": dist.get_rank(),
           "params": params, "peak_bytes": max(inside), "end_bytes": timeline[-1][1], "torch": torch.__version__}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(json.dumps(rows))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rows) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
