"""The short record of one device run (tests/gpu/run_all.sh), meant to be committed
under tests/gpu/results/: commit, source digest, date, GPUs, versions, and per pytest
run the counts, summary line, failed and skipped tests and the slowest tests.

    python tests/gpu/summarize_run.py OUT_DIR --commit HASH [--expect-gpu-tests] [--stage build=0 ...]
        writes OUT_DIR/summary.md; exits 1 if the run must not count as passed: a stage
        failed, an expected GPU junit file is missing or empty, or a GPU run has a
        failed, errored or skipped test.
    python tests/gpu/summarize_run.py --digest [ROOT]
        prints the digest of the source files under ROOT (default: the repository), to
        check that a summary describes the tree you have.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("src", "csrc", "tests", "examples", "benchmarks")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".sh"}
TOP_LEVEL_SOURCES = ("setup.py", "pyproject.toml")
# Generated or ignored by .gitignore: not part of what a commit holds.
SKIPPED_PARTS = {"__pycache__", "build", "dist", ".pytest_cache"}
SKIPPED_NAMES = {"_build_info.py"}

# (label, junit file, log file, is a GPU run) for every pytest run run_all.sh makes.
RUNS = (
    ("CPU/Gloo tests", "junit_cpu.xml", "pytest_cpu.log", False),
    ("GPU tests (parallel)", "junit_gpu.xml", "pytest_gpu.log", True),
    ("GPU tests (exclusive: timing)", "junit_gpu_exclusive.xml", "pytest_gpu_exclusive.log", True),
)


def source_digest(root: Path = REPO) -> str:
    """sha256 over the relative paths and contents of the source files, in path order."""
    files = [root / name for name in TOP_LEVEL_SOURCES if (root / name).is_file()]
    for top in SOURCE_DIRS:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            if (path.is_file() and path.suffix in SOURCE_SUFFIXES and path.name not in SKIPPED_NAMES
                    and not SKIPPED_PARTS.intersection(rel.parts) and not any(part.endswith(".egg-info") for part in rel.parts)):
                files.append(path)
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def read_junit(path: Path) -> Dict:
    """Counts, failed/errored/skipped test ids and per-test seconds from a pytest junit file."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    out = {"tests": 0, "passed": 0, "failed": [], "errors": [], "skipped": [], "seconds": 0.0, "times": []}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        seconds = float(case.get("time") or 0.0)
        out["tests"] += 1
        out["seconds"] += seconds
        out["times"].append((seconds, name))
        if case.find("failure") is not None:
            out["failed"].append(name)
        elif case.find("error") is not None:
            out["errors"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"].append(name)
        else:
            out["passed"] += 1
    return out


def pytest_summary_line(log: Path) -> Optional[str]:
    """The last `=== ... in 12.3s ===` line of a pytest log."""
    if not log.is_file():
        return None
    found = None
    for line in log.read_text(errors="replace").splitlines():
        if re.match(r"^=+ .* in [0-9.]+s.* =+$", line.strip()):
            found = line.strip()
    return found


def environment() -> List[str]:
    lines = [f"host: {platform.node()}, Python {platform.python_version()}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            lines.append(f"GPUs ({len(names)}): {', '.join(names)}")
            lines.append(f"NCCL {'.'.join(str(v) for v in torch.cuda.nccl.version())}")
        else:
            lines.append("GPUs: none visible to torch")
    except Exception as e:  # the summary must still be written
        lines.append(f"torch not usable: {e!r}")
    return lines


def summarize(out_dir: Path, commit: str, expect_gpu_tests: bool, stages: Dict[str, int]) -> List[str]:
    """Writes out_dir/summary.md; returns the reasons the run fails (empty: passed)."""
    problems = [f"stage {name} exited {rc}" for name, rc in stages.items() if rc != 0]
    check_file = out_dir / "gpu_check.txt"
    if check_file.is_file():
        problems.append(check_file.read_text().strip())
    rows, details = [], []
    for label, junit, log, gpu in RUNS:
        path = out_dir / junit
        if not path.is_file():
            if gpu and expect_gpu_tests:
                problems.append(f"{label}: no junit file {junit} (pytest did not run or crashed)")
            continue
        r = read_junit(path)
        rows.append(f"| {label} | {r['tests']} | {r['passed']} | {len(r['failed'])} | {len(r['errors'])} | "
                    f"{len(r['skipped'])} | {r['seconds']:.0f} |")
        if gpu:
            if r["tests"] == 0:
                problems.append(f"{label}: no test ran")
            if r["skipped"]:
                problems.append(f"{label}: {len(r['skipped'])} skipped (a GPU run must run every test)")
        if r["failed"] or r["errors"]:
            problems.append(f"{label}: {len(r['failed'])} failed, {len(r['errors'])} errors")
        details.append(f"\n### {label}\n")
        details.append(f"pytest: `{pytest_summary_line(out_dir / log) or 'no summary line in ' + log}`\n")
        for kind in ("failed", "errors", "skipped"):
            if r[kind]:
                details.append(f"{kind}:\n" + "".join(f"- `{name}`\n" for name in r[kind]))
        if gpu:
            slowest = sorted(r["times"], reverse=True)[:5]
            details.append("slowest:\n" + "".join(f"- {s:.1f} s `{name}`\n" for s, name in slowest))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# GPU run summary\n",
        f"- result: **{'FAIL' if problems else 'PASS'}**" + "".join(f"\n  - {p}" for p in problems),
        f"- commit: `{commit}`",
        f"- source digest: `{source_digest()}` (`python tests/gpu/summarize_run.py --digest`)",
        f"- date: {now}",
        f"- MFSDP_GPU_WORLD={os.environ.get('MFSDP_GPU_WORLD', '2')}, GPU_JOBS={os.environ.get('GPU_JOBS', '2')}",
        "- stages: " + (", ".join(f"{k}={v}" for k, v in stages.items()) or "none recorded"),
        *(f"- {line}" for line in environment()),
        "",
        "| pytest run | tests | passed | failed | errors | skipped | seconds (sum) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    env_file = out_dir / "env.txt"  # nvidia-smi and versions, written by run_all.sh
    if env_file.is_file():
        details.append("\n### env.txt\n\n```\n" + env_file.read_text(errors="replace").strip()[:4000] + "\n```\n")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n" + "".join(details))
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--expect-gpu-tests", action="store_true")
    p.add_argument("--stage", action="append", default=[], help="NAME=EXIT_CODE of a run_all.sh stage")
    p.add_argument("--digest", nargs="?", const=str(REPO), help="print the source digest of this tree and exit")
    args = p.parse_args(argv)
    if args.digest:
        print(source_digest(Path(args.digest)))
        return 0
    if not args.out_dir:
        p.error("OUT_DIR is required (or --digest)")
    stages = {}
    for item in args.stage:
        name, _, rc = item.partition("=")
        if not rc.lstrip("-").isdigit():
            p.error(f"--stage wants NAME=EXIT_CODE, got {item!r}")
        stages[name] = int(rc)
    problems = summarize(Path(args.out_dir), args.commit, args.expect_gpu_tests, stages)
    print((Path(args.out_dir) / "summary.md").read_text())
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
