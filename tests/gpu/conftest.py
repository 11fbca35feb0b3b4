"""GPU-suite run aids (tests/gpu/run_all.sh), both off unless their variable is set:

MFSDP_FAILURE_LOG=<file>: one line per test outcome (with its duration and the time since
the run began), and every failure's full report, appended as it happens, by the process
that prints the results (xdist's controller). A device call cut short by its time limit
then still returns what failed and why: pytest prints tracebacks only at its end.

MFSDP_GPU_TESTS_FIRST=<substring>,<substring>,...: tests whose id contains one of them run
first, in the order given (the rest after, in collection order): with a tight device
budget, what has not run yet on this machine comes before what has. Within each group,
tests marked `long_gpu` come first, so the parallel stage does not end on one long test
that started last.

MFSDP_GPU_SHARD=k/n: run the k-th of n parts of the suite (every n-th test of the order
above, from the k-th): a suite longer than one device call runs as n calls, each building
and running its part (tests/gpu/run_all.sh); together they run every test once.
"""
import os
import time

_START = time.time()
FAILURE_LOG_ENV = "MFSDP_FAILURE_LOG"
FIRST_ENV = "MFSDP_GPU_TESTS_FIRST"
SHARD_ENV = "MFSDP_GPU_SHARD"


def pytest_collection_modifyitems(config, items):
    first = [s for s in os.environ.get(FIRST_ENV, "").split(",") if s]

    def rank(item):
        named = next((i for i, s in enumerate(first) if s in item.nodeid), len(first))
        return named, item.get_closest_marker("long_gpu") is None

    items.sort(key=rank)  # stable: collection order within each group
    shard = os.environ.get(SHARD_ENV)
    if shard:
        index, count = _parse_shard(shard)
        # Round-robin over the order above (long tests first) spreads the long tests evenly.
        parts = ([], [])  # (deselected, kept)
        for i, item in enumerate(items):
            parts[i % count == index - 1].append(item)
        config.hook.pytest_deselected(items=parts[0])
        items[:] = parts[1]


def _parse_shard(text):
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise ValueError(f"{SHARD_ENV}={text!r}: expected k/n with 1 <= k <= n, e.g. 1/2")
    return index, count


def pytest_runtest_logreport(report):
    path = os.environ.get(FAILURE_LOG_ENV)
    # Under xdist a worker's reports reach the controller too: write them there only.
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and report.passed:
        return
    with open(path, "a") as f:
        f.write(f"[{time.time() - _START:7.1f}s] {report.outcome.upper():7} {report.when:8} "
                f"{report.duration:7.1f}s {report.nodeid}\n")
        if report.failed:
            f.write(report.longreprtext + "\n" + "-" * 100 + "\n")
        f.flush()
