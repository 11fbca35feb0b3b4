"""Summary of benchmarks/ab_train.sh: per (system, config), the step times of the base
and the new tree over the rounds (median, min, max) and the ratio of the medians.

    python benchmarks/ab_summary.py <dir holding base_<k>/results.json and new_<k>/results.json>
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(root: str) -> None:
    times = defaultdict(lambda: {"base": [], "new": []})
    for path in sorted(Path(root).glob("*_*/results.json")):
        side = path.parent.name.split("_")[0]
        for row in json.loads(path.read_text())["results"]:
            times[(row["system"], row["config"])][side].append(row["step_s"] * 1e3)
    print("| system | config | base ms (median, min-max) | new ms (median, min-max) | new / base |")
    print("| --- | --- | --- | --- | --- |")
    for (system, config), sides in sorted(times.items()):
        cells = []
        for side in ("base", "new"):
            v = sides[side]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}), n={len(v)}" if v else "-")
        ratio = (statistics.median(sides["new"]) / statistics.median(sides["base"])
                 if sides["new"] and sides["base"] else float("nan"))
        print(f"| {system} | {config} | {cells[0]} | {cells[1]} | {ratio:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
