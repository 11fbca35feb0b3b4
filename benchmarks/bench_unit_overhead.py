"""Per-unit CPU cost of the hooks: microseconds of CPU per unit per phase.

    torchrun --nproc_per_node=1 benchmarks/bench_unit_overhead.py --units 64 --out benchmarks/out/overhead

A Llama model of many tiny blocks (one unit each, plus the root) is trained twice in the
same process: plain (no sharding) and under fully_shard. Reported:
  - step_ms for both and (sharded - plain) / units: what one unit adds to a step;
  - per phase (pre_forward, post_forward, pre_backward, post_backward, and the C++
    unshard / reshard / collectives), the CPU microseconds per unit per step, from the
    library's own profiler scopes ("mfsdp::<phase>[<unit>]") over --profile-steps steps.
    Scopes nest (a collective runs inside a hook), so the phases are not summed;
  - with --op-table N, the N operators whose self CPU time grows most from the plain step
    to the sharded one (per unit per step, with the added calls): where the time goes.
At world 1 every collective is skipped: what remains is the hooks' own work. With
--device cuda the blocks are tiny kernels, so the CPU side is what the step waits for.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import init_benchmark_process, run_meta  # noqa: E402

_SCOPE = re.compile(r"^mfsdp::([a-z_]+)\[(.*)\]$")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", type=int, default=64, help="blocks, one unit each (the root is one more)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--op-table", type=int, default=0, metavar="N",
                   help="also list the N operators that add the most self CPU time per unit")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default="benchmarks/out/overhead")
    return p.parse_args()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step_times(model, opt, tokens, device, steps: int, warmup: int):
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        model.loss(tokens, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _profiled_steps(model, opt, tokens, device, steps: int):
    """`steps` training steps under the CPU profiler; returns the profile."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.loss(tokens, tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
    return prof


def _phase_us(model, opt, tokens, device, steps: int, units: int):
    prof = _profiled_steps(model, opt, tokens, device, steps)
    total = defaultdict(float)
    calls = defaultdict(int)
    for e in prof.events():
        m = _SCOPE.match(e.name)
        if m:
            total[m.group(1)] += e.cpu_time_total  # microseconds
            calls[m.group(1)] += 1
    return {phase: {"us_per_unit_per_step": total[phase] / (steps * units), "calls_per_step": calls[phase] / steps}
            for phase in sorted(total)}


def _op_self_us(model, opt, tokens, device, steps: int):
    """Self CPU microseconds and calls per step of every operator (and profiler scope)."""
    prof = _profiled_steps(model, opt, tokens, device, steps)
    ops = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        m = _SCOPE.match(e.key)  # one row per hook phase, not one per unit
        row = ops[f"mfsdp::{m.group(1)} (Python and C++ outside operators)" if m else e.key]
        row[0] += e.self_cpu_time_total / steps
        row[1] += e.count / steps
    return {k: tuple(v) for k, v in ops.items()}


def _op_table(plain_ops, sharded_ops, units: int, top: int):
    rows = []
    for key in set(plain_ops) | set(sharded_ops):
        us0, n0 = plain_ops.get(key, (0.0, 0.0))
        us1, n1 = sharded_ops.get(key, (0.0, 0.0))
        rows.append({"op": key, "added_self_us_per_unit": (us1 - us0) / units,
                     "added_calls_per_unit": (n1 - n0) / units})
    rows.sort(key=lambda r: r["added_self_us_per_unit"], reverse=True)
    return rows[:top]


def main():
    args = parse_args()
    device = init_benchmark_process(args.device, standalone_port=29563)
    cfg = LlamaConfig(vocab_size=128, d_model=args.width, n_layers=args.units, n_heads=4, ffn_hidden=2 * args.width)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    tokens = tokens.to(device)
    fused = device.type == "cuda" or None

    torch.manual_seed(0)
    plain = LlamaModel(cfg).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=fused)
    plain_times = _step_times(plain, plain_opt, tokens, device, args.steps, args.warmup)
    plain_ops = _op_self_us(plain, plain_opt, tokens, device, args.profile_steps) if args.op_table else {}
    del plain, plain_opt

    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    for block in model.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    times = _step_times(model, opt, tokens, device, args.steps, args.warmup)
    phases = _phase_us(model, opt, tokens, device, args.profile_steps, args.units + 1)
    ops = []
    if args.op_table:
        sharded_ops = _op_self_us(model, opt, tokens, device, args.profile_steps)
        ops = _op_table(plain_ops, sharded_ops, args.units + 1, args.op_table)

    # The slowest rank decides each step.
    both = torch.tensor([plain_times, times], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    plain_times, times = both.tolist()
    plain_ms, ms = statistics.median(plain_times) * 1e3, statistics.median(times) * 1e3
    result = {
        "units": args.units + 1, "width": args.width, "plain_step_ms": plain_ms, "sharded_step_ms": ms,
        "added_us_per_unit": (ms - plain_ms) * 1e3 / (args.units + 1), "phases": phases, "ops": ops,
        "plain_step_times_s": plain_times, "sharded_step_times_s": times,
    }
    if dist.get_rank() == 0:
        meta = dict(run_meta(device), steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps({"meta": meta, "result": result}, indent=2))
        print(f"{args.units + 1} units, world {dist.get_world_size()}, {device.type}: plain {plain_ms:.2f} ms, "
              f"sharded {ms:.2f} ms, +{result['added_us_per_unit']:.1f} us per unit per step")
        for phase, v in phases.items():
            print(f"  {phase:>18}: {v['us_per_unit_per_step']:8.1f} us per unit per step "
                  f"({v['calls_per_step']:.0f} calls per step)")
        if ops:
            print("  operators adding the most self CPU time (us per unit per step, calls per unit per step):")
        for r in ops:
            print(f"  {r['added_self_us_per_unit']:8.1f} {r['added_calls_per_unit']:6.1f}  {r['op'][:90]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
