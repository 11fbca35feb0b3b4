"""benchmarks/compare_systems.py under a time budget: runs that would not fit are recorded
as not run (the summary still written), a run's timeout is what is left, and a run that
times out takes torchrun's workers down with it."""
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
from harness.scripts import load_benchmark


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare_systems")


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_budget_starts_a_run_only_while_the_longest_fits(compare, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(compare, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    budget = compare.TimeBudget(100)
    assert budget.allows_a_run() and budget.timeout(300) == 100
    clock.now += 40
    budget.record(40)
    assert budget.allows_a_run() and budget.timeout(300) == 60 and budget.timeout(30) == 30
    clock.now += 25
    budget.record(25)  # the longest stays 40; 35 left
    assert budget.longest == 40 and not budget.allows_a_run()
    unlimited = compare.TimeBudget(0)
    unlimited.record(1e9)
    assert unlimited.allows_a_run() and unlimited.timeout(300) == 300


def test_comparison_records_the_runs_it_left_out(compare, monkeypatch, tmp_path):
    """Each run takes 10 s on the fake clock; a 25 s budget runs two of the four and the
    summary says which were not run."""
    clock = FakeClock()
    monkeypatch.setattr(compare, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    timeouts = []

    def fake_run(args, k, config, system, out, timeout):
        timeouts.append(timeout)
        clock.now += 10
        out.mkdir(parents=True, exist_ok=True)
        row = {"system": system, "config": config, "step_s": 0.1, "peak_mem_gib": 1.0, "tflops_per_gpu": 1.0}
        (out / "results.json").write_text(json.dumps({"meta": {"world": 2}, "results": [row]}))
        return dict(row, round=k)

    monkeypatch.setattr(compare, "run_system", fake_run)
    monkeypatch.setattr(compare, "plot_summary", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["compare_systems.py", "--rounds", "2", "--configs", "tiny", "--systems",
                                      "local,ddp", "--time-budget", "25", "--timeout", "300", "--out", str(tmp_path)])
    compare.main()
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["round"], r["system"], r.get("error")) for r in rows] == [
        (0, "local", None), (0, "ddp", None), (1, "ddp", compare.NOT_RUN), (1, "local", compare.NOT_RUN)]
    assert timeouts == [25, 15]
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["tiny/local"]["ok_rounds"] == 1 and summary["tiny/local"]["errors"] == [compare.NOT_RUN]


def test_a_timed_out_run_kills_its_whole_process_group(compare, tmp_path):
    """torchrun's workers are its children: a timeout must end them too, or they keep the
    GPUs the next run needs."""
    pid_file = tmp_path / "grandchild.pid"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; echo started; wait"]
    started = time.monotonic()
    returncode, output = compare._run_in_own_group(cmd, timeout=2, env=dict(os.environ))
    assert returncode is None and "started" in output
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # killed, not yet reaped by whoever adopted it
            return
        time.sleep(0.1)
    pytest.fail(f"the grandchild {grandchild} outlived its group's timeout (state {state})")
