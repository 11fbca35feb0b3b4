"""The checkpoint fuzzer of tests/distributed/test_checkpoint_trust.py, run longer: a
small checkpoint (two units, AdamW state, world 2 on Gloo) corrupted CASES times (bytes
flipped or a file truncated, each file in turn, the manifest recomputed so the hash check
passes) and loaded on every rank. Prints and writes (--out) the counts per outcome and
every case that neither loaded exactly nor failed naming the file.

    python benchmarks/fuzz_checkpoint.py --cases 3000 --seed 1 --out runs/fuzz.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import run_distributed  # noqa: E402
from harness.trust_workers import fuzz_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(fuzz_checkpoint, 2, tmp, args.cases, args.seed, timeout=max(600, args.cases))[0]
    out.update(cases=args.cases, seed=args.seed, seconds=round(time.perf_counter() - start, 1),
               meta={"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "host": platform.node(), "torch": torch.__version__,
                     "commit": os.environ.get("MFSDP_COMMIT"), "command": " ".join(sys.argv)})
    print(json.dumps({k: v for k, v in out.items() if k != "bad"}, indent=1))
    for line in out["bad"]:
        print("BAD:", line)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    sys.exit(1 if out["bad"] else 0)


if __name__ == "__main__":
    main()
