"""What a `__torch_function__` on sharded parameters would cost the training step's CPU
work: torch's AdamW step (foreach), `zero_grad(set_to_none=True)` and `clip_grad_norm_`
over N parameters of a `nn.Parameter` subclass, with the subclass's torch function
disabled (as ShardedParameter's is) and with a pass-through handler (the least a handler
that made parameter norms global would add). One process, CPU, no communication: the
cost measured is the Python dispatch itself. Prints and writes JSON.

    python benchmarks/bench_param_dispatch.py --params 440 --out benchmarks/data/x.json
"""
import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass


class Disabled(nn.Parameter):
    """Torch function disabled, as nn.Parameter's (and ShardedParameter's) is."""


class PassThrough(nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _time_ms(cls, what: str, n: int, numel: int, iters: int) -> float:
    params = [cls(torch.randn(numel)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    for _ in range(3):
        opt.step()
    grads = [p.grad for p in params]
    start = time.perf_counter()
    for _ in range(iters):
        if what == "adamw_step":
            opt.step()
        elif what == "zero_grad":
            for p, g in zip(params, grads):
                p.grad = g
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            start -= t0 - time.perf_counter()  # only zero_grad itself counts
        elif what == "clip_grad_norm":
            torch.nn.utils.clip_grad_norm_(params, 1e9)
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=440)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for what in ("adamw_step", "zero_grad", "clip_grad_norm"):
        runs = {"disabled": [], "pass_through": []}
        for _ in range(args.repeats):  # interleaved, so drift in the host's speed hits both
            runs["disabled"].append(_time_ms(Disabled, what, args.params, args.numel, args.iters))
            runs["pass_through"].append(_time_ms(PassThrough, what, args.params, args.numel, args.iters))
        row = {"what": what, **{f"{k}_ms": v for k, v in runs.items()},
               "median_disabled_ms": statistics.median(runs["disabled"]),
               "median_pass_through_ms": statistics.median(runs["pass_through"])}
        row["added_ms"] = row["median_pass_through_ms"] - row["median_disabled_ms"]
        rows.append(row)
        print(f"{what:15s} disabled {row['median_disabled_ms']:.2f} ms  pass-through "
              f"{row['median_pass_through_ms']:.2f} ms  added {row['added_ms']:+.2f} ms "
              f"(medians of {args.repeats}; {args.params} parameters)")
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": torch.get_num_threads(), "params": args.params, "numel": args.numel,
            "iters": args.iters, "repeats": args.repeats}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
