"""Scaling efficiency between bench_train runs at different world sizes.

    python benchmarks/scaling.py benchmarks/data/train_world2_h200_runE.json out4/results.json out8/results.json

The first file is the reference (normally 2 GPUs). For every (config, system) present
in both, efficiency = tokens/s/GPU at world N / tokens/s/GPU at the reference world:
1.00 means perfect weak scaling (each GPU keeps its micro-batch). Prints a markdown table
for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple


def load(path: str) -> Tuple[int, Dict[Tuple[str, str], dict]]:
    with open(path) as f:
        data = json.load(f)
    try:
        world = int(data["meta"]["world"])
        rows = {(r["config"], r["system"]): r for r in data["results"]}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a bench_train results.json (missing {e})") from None
    return world, rows


def scaling_rows(reference: str, others: List[str]) -> List[dict]:
    ref_world, ref = load(reference)
    out = []
    for path in others:
        world, rows = load(path)
        if world == ref_world:
            raise ValueError(f"{path} has the reference's world size ({world}); nothing to compare")
        for key, r in rows.items():
            base = ref.get(key)
            if base is None:
                continue
            out.append({
                "config": key[0], "system": key[1], "world": world, "ref_world": ref_world,
                "step_ms": r["step_s"] * 1e3, "ref_step_ms": base["step_s"] * 1e3,
                "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                "efficiency": r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
                "peak_mem_gib": r["peak_mem_gib"],
            })
    return out


def markdown(rows: List[dict]) -> str:
    lines = ["| config | system | GPUs | step ms | tokens/s/GPU | efficiency vs "
             f"{rows[0]['ref_world'] if rows else '?'} GPUs | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['system']} | {r['world']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['efficiency']:.2f} | {r['peak_mem_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", help="results.json of the reference world size")
    p.add_argument("others", nargs="+", help="results.json files of other world sizes")
    args = p.parse_args()
    print(markdown(scaling_rows(args.reference, args.others)))


if __name__ == "__main__":
    main()
