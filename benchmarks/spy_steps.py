"""Where the CPU goes in steady-state steps, per thread, from a sampling profiler
(py-spy) rather than torch.profiler, which inflates every scope it records.

    py-spy record -r 400 --threads -f raw -o spy.txt -- \\
        python3 benchmarks/spy_steps.py run --variant per_unit --steps 150
    python3 benchmarks/spy_steps.py summarize spy.txt --out spy_summary.json

`run` trains bench_unit_overhead.py's model (many tiny blocks, world 1) for --steps
steps after 10 warm-up ones and prints the step time split. `summarize` reads py-spy's
raw (collapsed) stacks and reports, per thread (on the main thread only samples inside
the steps), the share of samples each function is
on the stack (inclusive) and at its top (self). The backward runs on the autograd
engine's device thread; samples there with no Python frame are the engine's C++ work.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(args) -> None:
    import torch.distributed as dist

    from bench_unit_overhead import _config, _plain, _sharded, _step, _tokens
    from run_meta import init_benchmark_process

    device = init_benchmark_process("auto", standalone_port=29577)
    cfg = _config(args.units, args.width)
    tokens = _tokens(cfg, device, seed=0)
    model = _plain(cfg, device) if args.variant == "plain" else _sharded(cfg, device, args.variant, args.bucket_units)
    for _ in range(10):
        _step(*model, tokens, device)
    t0 = time.perf_counter()
    parts = [_step(*model, tokens, device) for _ in range(args.steps)]
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    split = {k: round(sum(p[k] for p in parts) / args.steps * 1e3, 2) for k in parts[0]}
    print(f"{args.variant}: {ms:.2f} ms per step {split}", flush=True)
    dist.destroy_process_group()


def summarize(args) -> None:
    inclusive: dict = defaultdict(Counter)
    top: dict = defaultdict(Counter)
    samples: Counter = Counter()
    rows = []
    for line in Path(args.raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        # py-spy names a thread ("thread (N): MainThread") only once it knows the name.
        rows.append((frames[0].split(":")[0], [f.split(" (")[0] for f in frames[1:]], int(count)))
    # A thread that runs the steps counts only its samples inside them (not the imports
    # and the model build); other threads (the autograd engine's) count whole.
    in_steps = {thread for thread, frames, _ in rows if args.within in frames}
    for thread, frames, n in rows:
        if thread in in_steps and args.within not in frames:
            continue
        samples[thread] += n
        for name in set(frames):
            inclusive[thread][name] += n
        top[thread][frames[-1] if frames else "(no Python frame)"] += n
    out = {}
    for thread, total in samples.most_common():
        out[thread] = {
            "samples": total,
            "inclusive_pct": {k: round(100 * v / total, 2) for k, v in inclusive[thread].most_common(args.top)},
            "self_pct": {k: round(100 * v / total, 2) for k, v in top[thread].most_common(args.top)},
        }
        print(f"{thread}: {total} samples")
        for k, v in out[thread]["inclusive_pct"].items():
            print(f"  {v:6.2f}% on stack  {k}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--variant", choices=["plain", "per_unit", "bucketed"], default="per_unit")
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--units", type=int, default=64)
    r.add_argument("--width", type=int, default=64)
    r.add_argument("--bucket-units", type=int, default=8)
    s = sub.add_parser("summarize")
    s.add_argument("raw")
    s.add_argument("--top", type=int, default=40)
    s.add_argument("--within", default="_step", help="the function whose samples count on the thread that runs it")
    s.add_argument("--out", default="")
    args = p.parse_args()
    run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    main()
