"""Every system in its own process, interleaved and repeated: the comparison to report.

    python benchmarks/compare_systems.py --nproc 2 --rounds 3 --configs small_many,1b_comm_bound \
        --systems local,ddp,mfsdp,fsdp2 --out benchmarks/out/compare

For each round, each config and each system (the order of systems rotates every round, so
no system always runs first or last), one `torchrun bench_train.py` process trains that
system alone; its results.json lands under --out/round<k>/<config>/<system>/. A system
that fails (out of memory, a missing package) is recorded with its error and the run goes
on. The summary (--out/summary.json and summary.md) gives per system and config the
median over rounds of the per-round median step time, the min-max over rounds, the peak
memory, and the ratios of the medians against fsdp2, ddp and local (the no-communication
limit), and step_time.png plots the medians with their min-max. `--device cpu` runs the
same on Gloo (a smoke run, not a measurement). `--replot SUMMARY_JSON` only redraws the
plot of a saved summary (next to it). `--time-budget S` fits the whole comparison into S
seconds (a device call's limit): a run starts only while the time left is at least the
longest run so far, and may take no more than what is left; the runs it leaves out are
recorded as not run, and the summary is written as for a complete comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="small_many,1b_comm_bound,1b,8b_ish")
    p.add_argument("--systems", default="local,ddp,mfsdp,fsdp2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout", type=float, default=900, help="seconds one system's process may take")
    p.add_argument("--out", default="benchmarks/out/compare")
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds for the whole comparison (0: no limit); runs that would not fit are not started")
    p.add_argument("--bench-args", default="", help="more bench_train.py arguments for every run, e.g. "
                   "'--experts 16 --ep 4' (a mixture of experts with expert parallelism)")
    p.add_argument("--replot", default="", metavar="SUMMARY_JSON",
                   help="draw step_time.png from a saved summary.json and exit (runs nothing)")
    return p.parse_args()


def _cause(output: str) -> str:
    """The line of a failed run's output that says why (torchrun ends with banners)."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=-")]
    # What the ranks printed comes before torchrun's own report of the failed child.
    launcher = next((i for i, line in enumerate(lines) if "torch.distributed.elastic" in line
                     or "ChildFailedError" in line or line.startswith("[rank") and "Failures:" in line), None)
    lines = lines[:launcher] if launcher else lines
    telling = [line for line in lines if re.search(r"Error|Exception|unknown|out of memory|Traceback", line)]
    telling = [line for line in telling if not line.startswith("Traceback")] or telling
    return telling[-1] if telling else (lines[-1] if lines else "no output")


NOT_RUN = "not run: the time budget was spent"


class TimeBudget:
    """The comparison's time left (`--time-budget`; 0: none): a run starts only while what
    is left covers the longest run so far, and its timeout is at most what is left."""

    def __init__(self, seconds: float):
        self._end = time.monotonic() + seconds if seconds > 0 else None
        self.longest = 0.0

    def left(self) -> float:
        return float("inf") if self._end is None else self._end - time.monotonic()

    def allows_a_run(self) -> bool:
        left = self.left()
        return left > 0 and left >= self.longest

    def timeout(self, limit: float) -> float:
        return min(limit, self.left())

    def record(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def _run_in_own_group(cmd, timeout: float, env: dict):
    """Run `cmd` in a process group of its own, so that a timeout kills torchrun's workers
    too (they would hold the GPUs the next run needs). Returns (returncode, output), with
    returncode None on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output


def run_system(args, k: int, config: str, system: str, out: Path, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # torchrun without --log-dir makes a torchelastic_* directory in /tmp and never removes it.
    with tempfile.TemporaryDirectory(prefix="mfsdp_torchrun_") as log_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               f"--master_port={args.port}", f"--log-dir={log_dir}", str(HERE / "bench_train.py"),
               "--configs", config, "--systems", system, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--device", args.device, "--out", str(out), "--timeline", ""] + shlex.split(args.bench_args)
        returncode, output = _run_in_own_group(cmd, timeout, env)
    (out / "log.txt").write_text(output)
    if returncode is None:
        error = f"timed out after {timeout:.0f} s"
    elif returncode == 0 and (out / "results.json").exists():
        row = json.loads((out / "results.json").read_text())["results"][0]
        return dict(row, round=k)
    else:
        error = f"exit {returncode}: {_cause(output)}"
    return {"system": system, "config": config, "round": k, "error": error}


def summarize(rows: list) -> dict:
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["system"]), []).append(r)
    summary = {}
    for (config, system), rs in by.items():
        ok = [r for r in rs if "error" not in r]
        entry = {"config": config, "system": system, "rounds": len(rs), "ok_rounds": len(ok),
                 "errors": sorted({r["error"] for r in rs if "error" in r})}
        if ok:
            medians = [r["step_s"] * 1e3 for r in ok]
            entry.update(step_ms=statistics.median(medians), step_ms_min=min(medians), step_ms_max=max(medians),
                         round_medians_ms=medians, peak_mem_gib=max(r["peak_mem_gib"] for r in ok),
                         tflops_per_gpu=statistics.median(r["tflops_per_gpu"] for r in ok))
        summary[f"{config}/{system}"] = entry
    for entry in summary.values():
        for peer in ("fsdp2", "ddp", "local"):
            other = summary.get(f"{entry['config']}/{peer}")
            if "step_ms" in entry and other and "step_ms" in other:
                entry[f"vs_{peer}"] = entry["step_ms"] / other["step_ms"]
    return summary


def write_summary(summary: dict, meta: dict, out: Path) -> None:
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2))
    lines = ["| config | system | step ms, median of rounds (min-max) | peak GiB | vs FSDP2 | vs DDP | vs local |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in summary.values():
        if "step_ms" not in e:
            lines.append(f"| {e['config']} | {e['system']} | failed: {'; '.join(e['errors'])} | - | - | - | - |")
            continue
        ratios = [f"{e[f'vs_{p}']:.2f}x" if f"vs_{p}" in e else "-" for p in ("fsdp2", "ddp", "local")]
        lines.append(f"| {e['config']} | {e['system']} | {e['step_ms']:.1f} ({e['step_ms_min']:.1f}-"
                     f"{e['step_ms_max']:.1f}), n={e['ok_rounds']} | {e['peak_mem_gib']:.2f} | " + " | ".join(ratios)
                     + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    plot_summary(summary, meta, out / "step_time.png")


def plot_summary(summary: dict, meta: dict, path: Path) -> None:
    """Median step time per config (one group of bars) and system, with the min-max over
    rounds as error bars; a failed system gets no bar."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    entries = [e for e in summary.values() if "step_ms" in e]
    if not entries:
        return
    configs = list(dict.fromkeys(e["config"] for e in entries))
    systems = list(dict.fromkeys(e["system"] for e in entries))
    by = {(e["config"], e["system"]): e for e in entries}
    fig, axes = plt.subplots(1, len(configs), figsize=(1.2 + 1.1 * len(systems) * len(configs), 4.2), dpi=120,
                             squeeze=False)
    for ax, config in zip(axes[0], configs):
        names = [s for s in systems if (config, s) in by]
        mids = [by[(config, s)]["step_ms"] for s in names]
        low = [m - by[(config, s)]["step_ms_min"] for m, s in zip(mids, names)]
        high = [by[(config, s)]["step_ms_max"] - m for m, s in zip(mids, names)]
        bars = ax.bar(range(len(names)), mids, yerr=[low, high], capsize=3,
                      color=[f"C{systems.index(s)}" for s in names])
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(config)
        ax.set_ylabel("step ms (median of rounds, min-max)")
    rounds = max(e["rounds"] for e in entries)
    fig.suptitle(f"{meta.get('world', '?')}x {meta.get('device_name', '?')}, torch {meta.get('torch', '?')}, "
                 f"{rounds} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    args = parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot_summary(saved["summary"], saved["meta"], Path(args.replot).with_name("step_time.png"))
        return
    out = Path(args.out)
    systems, configs = args.systems.split(","), args.configs.split(",")
    rows, meta = [], None
    budget = TimeBudget(args.time_budget)
    for k in range(args.rounds):
        order = systems[k % len(systems):] + systems[:k % len(systems)]
        for config in configs:
            for system in order:
                if budget.allows_a_run():
                    started = time.monotonic()
                    row = run_system(args, k, config, system, out / f"round{k}" / config / system,
                                     budget.timeout(args.timeout))
                    budget.record(time.monotonic() - started)
                else:
                    row = {"system": system, "config": config, "round": k, "error": NOT_RUN}
                rows.append(row)
                print(f"round {k} {config:>14} {system:>16}: "
                      + (f"{row['step_s'] * 1e3:.1f} ms" if "error" not in row else row["error"]), flush=True)
                if meta is None and "error" not in row:
                    meta = json.loads((out / f"round{k}" / config / system / "results.json").read_text())["meta"]
                # After every run: a call cut by its time limit keeps what finished.
                (out / "rows.json").write_text(json.dumps(rows, indent=2))
    meta = dict(meta or {}, command=" ".join([Path(sys.executable).name] + sys.argv), rounds=args.rounds,
                interleaving="each system in its own torchrun process; order of systems rotated every round")
    write_summary(summarize(rows), meta, out)


if __name__ == "__main__":
    main()
