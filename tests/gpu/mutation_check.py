"""Does the GPU suite catch what it must? Each mutation below is applied to the C++ source,
the extension is rebuilt in place (only the changed file recompiles), the tests named for
it run, and the source is restored. A mutation is caught when a test that must fail does.
Prints a markdown table; exits non-zero if a mutation that must be caught is not.

Usage (GPU machine, repo root, after an in-place build, e.g. by run_one_gpu.sh):
    MFSDP_GPU_BACKEND=gloo MFSDP_GPU_WORLD=2 PYTHONPATH=src:tests python tests/gpu/mutation_check.py [out.md]
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARITY = "tests/gpu/test_nccl.py::test_nccl_parity[adamw]"
CHAOS = "tests/gpu/test_nccl.py::test_nccl_parity_under_stream_chaos[adamw]"

# (name, file, original, mutated, tests that must fail, tests reported only)
MUTATIONS = [
    ("gradient scale doubled", "csrc/unit_reduce.cpp",
     "return 1.0 / (grad_divide_factor_ > 0 ? grad_divide_factor_ : mean_over);",
     "return 2.0 / (grad_divide_factor_ > 0 ? grad_divide_factor_ : mean_over);",
     [PARITY], []),
    ("shard offset off by one element", "csrc/unit.cpp",
     "  return full.reshape({-1}).narrow(0, s.param_offset, s.numel);",
     "  return full.reshape({-1}).narrow(0, s.param_offset > 0 ? s.param_offset - 1 : 0, s.numel);",
     [PARITY], []),
    # The optimizer's stream does not wait for the gradient reduction: stream chaos (a
    # delay on the reduce-scatter stream after the collective, before the gradients land)
    # must catch it; the plain parity test is reported beside it.
    ("compute stream skips the wait for the reduction", "csrc/comm_context.cpp",
     "  inflight_->done->wait();\n", "  // mutated: no wait\n",
     [CHAOS], [PARITY]),
    # The compute stream does not wait for the all-gather. Under NCCL stream chaos catches
    # it; where the host waits for the collective itself (Gloo) only the copy back to the
    # device can race, so this one is reported, not required.
    ("compute stream skips the wait for the all-gather", "csrc/unit_gather.cpp",
     "    gathered_->block(current_stream(device_));\n", "    // mutated: no wait\n",
     [CHAOS] if os.environ.get("MFSDP_GPU_BACKEND", "nccl") == "nccl" else [], [CHAOS]),
]


def build() -> None:
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   env=dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "16")))


def passes(test: str) -> bool:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    return proc.returncode == 0


def main() -> int:
    rows = ["| mutation | must fail | result | also ran |", "|---|---|---|---|"]
    missed = 0
    for name, rel, original, mutated, required, reported in MUTATIONS:
        path = REPO / rel
        text = path.read_text()
        assert text.count(original) == 1, f"{name}: the original line is not in {rel} exactly once"
        path.write_text(text.replace(original, mutated))
        try:
            build()
            results = {t: passes(t) for t in dict.fromkeys(required + reported)}
        finally:
            path.write_text(text)
        caught = all(not results[t] for t in required)
        missed += bool(required) and not caught
        must = ", ".join(f"{t.split('::')[-1]}: {'failed' if not results[t] else 'PASSED'}" for t in required) or "-"
        also = ", ".join(f"{t.split('::')[-1]}: {'failed' if not results[t] else 'passed'}" for t in reported) or "-"
        verdict = ("caught" if caught else "NOT CAUGHT") if required else "not required on this backend"
        rows.append(f"| {name} | {must} | {verdict} | {also} |")
        print(rows[-1], flush=True)
    build()  # restored sources
    text = "\n".join(rows)
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
