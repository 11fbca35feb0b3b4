"""Per-unit CPU cost of the hooks: microseconds of CPU per unit per phase.

    torchrun --nproc_per_node=1 benchmarks/bench_unit_overhead.py --units 64 --out benchmarks/out/overhead

A Llama model of many tiny blocks (one unit each, plus the root) is trained in the same
process plain (no sharding) and under fully_shard in each of --variants:
  - per_unit: one all-gather and one reduce-scatter per unit;
  - bucketed: gather and reduce buckets of --bucket-units units each (bytes from the
    units' sizes), one coalesced collective per bucket.
The models take their timed steps in turn (order rotated each round), so the host's
drifts fall on all of them alike. Reported for each variant:
  - step_ms and (sharded - plain) / units: what one unit adds to a step, and each step
    split into the forward call, the backward call, the optimizer and the drain (the
    wait for the GPU at the end), plus the garbage collector's time per step;
  - hook_clock: wall-clock microseconds per unit per step inside the hooks' Python
    entry points (pre_forward, post_forward, pre_backward, post_backward and the final
    callback, the C++ work they call included), unprofiled, in the same timed steps:
    the rest of the added time is outside them (the post-backward marker node, the
    autograd engine, module-call dispatch, the optimizer);
  - per phase (pre_forward, post_forward, pre_backward, post_backward, and the C++
    unshard / reshard / collectives), the CPU microseconds per unit per step, from the
    library's own profiler scopes ("mfsdp::<phase>[<unit>]") over --profile-steps steps.
    Scopes nest (a collective runs inside a hook), so the phases are not summed, and the
    profiler inflates every scope;
  - with --op-table N, the N operators whose self CPU time grows most from the plain step
    to the sharded one (per unit per step, with the added calls): where the time goes;
  - with --python-profile N, the same for Python functions and builtins under cProfile
    (which charges each call about a microsecond: for ranking, not for totals).
At world 1 every collective is skipped: what remains is the hooks' own work. With
--device cuda the blocks are tiny kernels, so the CPU side is what the step waits for.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.hooks import FSDPState
from megatron_fsdp_ext.core.root_context import RootContext
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import init_benchmark_process, run_meta  # noqa: E402

_SCOPE = re.compile(r"^mfsdp::([a-z_]+)\[(.*)\]$")


VARIANTS = ("per_unit", "bucketed")

# The hooks' Python entry points; every other hook method runs inside one of them.
_HOOK_ENTRIES = (
    (FSDPState, "_pre_forward", "pre_forward"),
    (FSDPState, "_post_forward", "post_forward"),
    (FSDPState, "_pre_backward_hook", "pre_backward"),
    (FSDPState, "post_backward_of_one_call", "post_backward"),
    (RootContext, "_final_callback", "final_callback"),
)


@contextlib.contextmanager
def hook_clock():
    """Adds up perf_counter time spent inside each hook entry point (outermost calls only)
    while active; yields {entry: [seconds, calls]}. Active while the model is built (the
    module hooks bind at fully_shard) and while it runs."""
    totals = {name: [0.0, 0] for _, _, name in _HOOK_ENTRIES}
    depth = [0]

    def timed(method, name):
        @functools.wraps(method)
        def run(*args, **kwargs):
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                row = totals[name]
                row[0] += time.perf_counter() - t0
                row[1] += 1
                depth[0] -= 1
        return run

    originals = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in _HOOK_ENTRIES]
    for (cls, attr, name), (_, _, method) in zip(_HOOK_ENTRIES, originals):
        setattr(cls, attr, timed(method, name))
    try:
        yield totals
    finally:
        for cls, attr, method in originals:
            setattr(cls, attr, method)


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
    p.add_argument("--variants", default="per_unit,bucketed", help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--bucket-units", type=int, default=8,
                   help="bucketed: units per gather and per reduce bucket (their bytes set the budgets)")
    p.add_argument("--python-profile", type=int, default=0, metavar="N",
                   help="also list the N Python functions and builtins (cProfile) whose self time grows most "
                        "from the plain step to the sharded one, per unit per step")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the sharded models compute in bf16 (MixedPrecisionPolicy, fp32 reduce, inputs "
                        "cast per unit), the plain model is bf16 throughout")
    p.add_argument("--out", default="benchmarks/out/overhead")
    return p.parse_args()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


_STEP_PARTS = ("forward", "backward", "optimizer", "drain")


def _step(model, opt, tokens, device):
    """One training step from a synchronized start: its wall seconds split into the
    forward call, the backward call, optimizer step + zero_grad, and the drain (waiting
    at the end for the GPU: long when the GPU, not the CPU, is behind)."""
    _sync(device)
    t0 = time.perf_counter()
    loss = model.loss(tokens, tokens)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    _sync(device)
    t4 = time.perf_counter()
    return dict(zip(_STEP_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)))


class _GcClock:
    """Seconds the garbage collector ran, added to whoever is `current`."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.current = None
        self._t0 = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.current is not None:
            self.seconds[self.current] += time.perf_counter() - self._t0


def _interleaved(models: dict, tokens, device, steps: int, warmup: int, clock_totals, units: int) -> dict:
    """Steps of every model in turn (the order rotated each round), so that the host's
    drifts (large on shared GPU hosts) fall on all of them alike: per model the step
    times, the median of each part, the garbage collector's time and the hook clock."""
    import gc

    names = list(models)
    times = {n: [] for n in names}
    parts = {n: defaultdict(list) for n in names}
    clock = {n: {k: [0.0, 0] for k in clock_totals} for n in names}
    gc_clock = _GcClock()
    gc.collect()  # the garbage of building the models is not the steps' to pay
    gc.callbacks.append(gc_clock)
    try:
        for i in range(warmup + steps):
            for name in names[i % len(names):] + names[:i % len(names)]:
                before = {k: list(v) for k, v in clock_totals.items()}
                gc_clock.current = name if i >= warmup else None
                split = _step(*models[name], tokens, device)
                gc_clock.current = None
                if i < warmup:
                    continue
                times[name].append(sum(split.values()))
                for k, v in split.items():
                    parts[name][k].append(v)
                for k, v in clock_totals.items():
                    clock[name][k][0] += v[0] - before[k][0]
                    clock[name][k][1] += v[1] - before[k][1]
    finally:
        gc.callbacks.remove(gc_clock)
    out = {}
    for n in names:
        hook = {k: {"us_per_unit_per_step": sec * 1e6 / (steps * units), "calls_per_step": calls / steps}
                for k, (sec, calls) in clock[n].items()}
        out[n] = {"step_times_s": _slowest_rank(times[n], device),
                  "step_parts_ms": {k: statistics.median(v) * 1e3 for k, v in parts[n].items()},
                  "gc_ms_per_step": gc_clock.seconds[n] * 1e3 / steps,
                  "hook_clock": hook,
                  "hook_clock_us_per_unit": sum(v["us_per_unit_per_step"] for v in hook.values())}
        out[n]["step_ms"] = statistics.median(out[n]["step_times_s"]) * 1e3
    return out


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


def _python_self_us(model, opt, tokens, device, steps: int):
    """Self microseconds and calls per step of every Python function and builtin (C++
    entry points included) under cProfile, keyed "file:line(function)" with the path
    shortened to what follows site-packages/ or src/. cProfile charges each call about
    a microsecond: compare rows, not totals."""
    prof = cProfile.Profile()
    _sync(device)
    prof.enable()
    for _ in range(steps):
        _step(model, opt, tokens, device)
    prof.disable()
    rows = {}
    for (path, line, func), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        short = re.sub(r"^.*/(site-packages|src)/", "", path)
        key = f"{short}:{line}({func})" if line else func
        us, n = rows.get(key, (0.0, 0.0))
        rows[key] = (us + tottime * 1e6 / steps, n + ncalls / steps)
    return rows


def _op_table(plain_ops, sharded_ops, units: int, top: int):
    rows = []
    for key in set(plain_ops) | set(sharded_ops):
        us0, n0 = plain_ops.get(key, (0.0, 0.0))
        us1, n1 = sharded_ops.get(key, (0.0, 0.0))
        rows.append({"op": key, "added_self_us_per_unit": (us1 - us0) / units,
                     "added_calls_per_unit": (n1 - n0) / units})
    rows.sort(key=lambda r: r["added_self_us_per_unit"], reverse=True)
    return rows[:top]


def _config(units: int, width: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, d_model=width, n_layers=units, n_heads=4, ffn_hidden=2 * width)


def _tokens(cfg: LlamaConfig, device, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed)).to(device)


def _with_adamw(model, device):
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)


def _plain(cfg, device, param_dtype: str = "fp32"):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if param_dtype == "bf16" else torch.float32
    return _with_adamw(LlamaModel(cfg).to(device=device, dtype=dtype), device)


def _sharded(cfg, device, variant: str, bucket_units: int, param_dtype: str = "fp32"):
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    mp = {}
    if param_dtype == "bf16":
        mp["mp_policy"] = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        mfsdp.fully_shard(block, **mp)
    gather_bytes = reduce_bytes = 0
    if variant == "bucketed":
        # Units are alike: a budget of bucket_units blocks' bytes puts that many in a bucket.
        block = model.blocks[0]._mfsdp_state.unit
        gather_bytes = bucket_units * block.unsharded_nbytes
        reduce_bytes = bucket_units * block.layout.total_numel * block.reduce_dtype.itemsize
    mfsdp.fully_shard(model, gather_bucket_bytes=gather_bytes, reduce_bucket_bytes=reduce_bytes, **mp)
    return _with_adamw(model, device)


def _slowest_rank(times, device):
    both = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both.tolist()


def main():
    args = parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise SystemExit(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    device = init_benchmark_process(args.device, standalone_port=29563)
    cfg = _config(args.units, args.width)
    tokens = _tokens(cfg, device, seed=dist.get_rank())
    units = args.units + 1

    models = {"plain": _plain(cfg, device, args.param_dtype)}
    # The clock stays on for the whole run: the timed steps pay its two perf_counter
    # reads per hook entry (well under a microsecond each) as the clocked ones do.
    with hook_clock() as clock_totals:
        for variant in variants:
            models[variant] = _sharded(cfg, device, variant, args.bucket_units, args.param_dtype)
        for model, opt in models.values():  # the recording step and the first bucketed one
            for _ in range(2):
                _step(model, opt, tokens, device)
        timed = _interleaved(models, tokens, device, args.steps, args.warmup, clock_totals, units)
        plain_ops = _op_self_us(*models["plain"], tokens, device, args.profile_steps) if args.op_table else {}
        plain_py = _python_self_us(*models["plain"], tokens, device, args.profile_steps) if args.python_profile else {}
        results = {}
        for variant in variants:
            r = timed[variant]
            r["added_us_per_unit"] = (r["step_ms"] - timed["plain"]["step_ms"]) * 1e3 / units
            r["phases"] = _phase_us(*models[variant], tokens, device, args.profile_steps, units)
            r["ops"] = _op_table(plain_ops, _op_self_us(*models[variant], tokens, device, args.profile_steps),
                                 units, args.op_table) if args.op_table else []
            r["python"] = _op_table(plain_py, _python_self_us(*models[variant], tokens, device, args.profile_steps),
                                    units, args.python_profile) if args.python_profile else []
            results[variant] = r
    plain_ms = timed["plain"]["step_ms"]
    result = {"units": units, "width": args.width, "bucket_units": args.bucket_units, "param_dtype": args.param_dtype,
              "plain_step_ms": plain_ms, "plain_step_times_s": timed["plain"]["step_times_s"],
              "plain_step_parts_ms": timed["plain"]["step_parts_ms"],
              "plain_gc_ms_per_step": timed["plain"]["gc_ms_per_step"], "variants": results}
    if dist.get_rank() == 0:
        meta = dict(run_meta(device), steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps({"meta": meta, "result": result}, indent=2))
        def split(p):
            return ", ".join(f"{k} {v:.2f}" for k, v in p.items())

        print(f"{units} units, world {dist.get_world_size()}, {device.type}, steps interleaved: plain {plain_ms:.2f} ms "
              f"({split(result['plain_step_parts_ms'])}; gc {result['plain_gc_ms_per_step']:.2f})")
        for variant, r in results.items():
            print(f"{variant}: step {r['step_ms']:.2f} ms ({split(r['step_parts_ms'])}; gc {r['gc_ms_per_step']:.2f}), "
                  f"+{r['added_us_per_unit']:.1f} us per unit per step; "
                  f"inside the hooks (unprofiled) {r['hook_clock_us_per_unit']:.1f} us per unit per step")
            for name, v in r["hook_clock"].items():
                print(f"  clock {name:>16}: {v['us_per_unit_per_step']:8.1f} us per unit per step "
                      f"({v['calls_per_step']:.0f} calls per step)")
            for phase, v in r["phases"].items():
                print(f"  scope {phase:>16}: {v['us_per_unit_per_step']:8.1f} us per unit per step "
                      f"({v['calls_per_step']:.0f} calls per step, profiled)")
            if r["ops"]:
                print("  operators adding the most self CPU time (us per unit per step, calls per unit per step):")
            for row in r["ops"]:
                print(f"  {row['added_self_us_per_unit']:8.1f} {row['added_calls_per_unit']:6.1f}  {row['op'][:90]}")
            if r["python"]:
                print("  Python functions and builtins adding the most self time under cProfile (us per unit per step, "
                      "calls per unit per step):")
            for row in r["python"]:
                print(f"  {row['added_self_us_per_unit']:8.1f} {row['added_calls_per_unit']:6.1f}  {row['op'][:100]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
