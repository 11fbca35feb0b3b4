"""Summary of benchmarks/ab_unit_overhead.sh: per side, over the rounds, the per-unit
cost (added per unit per step, time inside the hooks) and the checkpoint save and load
times, as median (min-max), and the ratio of the medians; rounds paired.

    python benchmarks/ab_overhead_summary.py <OUT of ab_unit_overhead.sh>
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _rows(root: Path, sub: str, pick) -> dict:
    sides = {"base": {}, "new": {}}
    for path in sorted((root / sub).glob("*_*.json")):
        side, round_ = path.stem.split("_")
        sides[side][int(round_)] = pick(json.loads(path.read_text()))
    return sides


def _line(name: str, sides: dict, unit: str) -> str:
    cells = []
    for side in ("base", "new"):
        v = list(sides[side].values())
        cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}), n={len(v)}" if v else "-")
    paired = [sides["new"][r] - sides["base"][r] for r in sides["new"] if r in sides["base"]]
    ratio = (statistics.median(sides["new"].values()) / statistics.median(sides["base"].values())
             if sides["new"] and sides["base"] else float("nan"))
    diff = f"{statistics.median(paired):+.1f} ({min(paired):+.1f} to {max(paired):+.1f})" if paired else "-"
    return f"| {name} ({unit}) | {cells[0]} | {cells[1]} | {ratio:.3f} | {diff} |"


def main(root: str) -> None:
    out = Path(root)
    per_unit = lambda d: d["result"]["variants"]["per_unit"]  # noqa: E731
    print("| measure | base, median (min-max) | new, median (min-max) | new / base | paired new - base, median (range) |")
    print("| --- | --- | --- | --- | --- |")
    print(_line("added per unit per step", _rows(out, "ab_overhead", lambda d: per_unit(d)["added_us_per_unit"]), "us"))
    print(_line("inside the hooks per unit", _rows(out, "ab_overhead", lambda d: per_unit(d)["hook_clock_us_per_unit"]),
                "us"))
    print(_line("sharded step", _rows(out, "ab_overhead", lambda d: per_unit(d)["step_ms"]), "ms"))
    print(_line("plain step", _rows(out, "ab_overhead", lambda d: d["result"]["plain_step_ms"]), "ms"))
    if (out / "ab_checkpoint").is_dir():
        print(_line("save_checkpoint", _rows(out, "ab_checkpoint", lambda d: d["save_s"]["median"] * 1e3), "ms"))
        print(_line("load_checkpoint", _rows(out, "ab_checkpoint", lambda d: d["load_s"]["median"] * 1e3), "ms"))


if __name__ == "__main__":
    main(sys.argv[1])
