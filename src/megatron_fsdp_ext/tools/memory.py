"""What is live at the peak of a CUDA memory-history snapshot
(`torch.cuda.memory._record_memory_history` + `_dump_snapshot`), for the benchmark's
peak-memory comparisons:

    python -m megatron_fsdp_ext.tools.memory benchmarks/out/memory_mfsdp_8b_ish.pickle
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Dict, List, Tuple

from ..checkpoint.reader import load_plain_pickle

# Allocations made before recording began are not in the trace; `live_at_peak` counts
# only what the trace allocated (the benchmark records from before the model is built).


def _origin(frames: List[dict]) -> str:
    """The innermost Python frame outside torch itself: where the allocation came from."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')} {frames[0].get('name')}" \
        if frames else "?"


def live_at_peak(snapshot: dict, device: int = 0) -> Tuple[int, int, List[Tuple[str, int, int]]]:
    """Replays the trace of `device`. Returns (peak bytes, trace index of the peak, and the
    live allocations at the peak grouped by origin: (origin, count, bytes), largest first,
    then by origin).
    Memory counts as freed when the program frees it (`free_requested`), as the
    allocator's allocated-bytes statistic does."""
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        raise ValueError(f"snapshot has traces for {len(traces)} devices, asked for device {device}")
    live: Dict[int, Tuple[int, str]] = {}
    total = peak = peak_at = 0
    peak_live: Dict[int, Tuple[int, str]] = {}
    for i, ev in enumerate(traces[device]):
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc":
            live[addr] = (ev["size"], _origin(ev.get("frames", [])))
            total += ev["size"]
            if total > peak:
                peak, peak_at, peak_live = total, i, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for size, origin in peak_live.values():
        groups[origin][0] += 1
        groups[origin][1] += size
    rows = sorted(((o, c, b) for o, (c, b) in groups.items()), key=lambda r: (-r[2], r[0]))
    return peak, peak_at, rows


def large_events_to(snapshot: dict, until: int, device: int = 0, min_bytes: int = 64 << 20,
                    last: int = 120) -> List[list]:
    """The last `last` allocations and frees of at least `min_bytes` in the trace of
    `device` up to event `until` (e.g. the peak live_at_peak found): [event index, action,
    MiB, the allocation's origin as live_at_peak names it]."""
    events, origins = [], {}
    for i, ev in enumerate(snapshot["device_traces"][device][:until + 1]):
        action, size = ev.get("action"), ev.get("size", 0)
        if action == "alloc":
            origins[ev["addr"]] = _origin(ev.get("frames", []))
        if size >= min_bytes and action in ("alloc", "free_requested"):
            events.append([i, action, round(size / 2**20, 1), origins.get(ev.get("addr"), "?")])
    return events[-last:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshots", nargs="+")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.snapshots:
        with open(path, "rb") as f:
            snap = load_plain_pickle(f, path)
        peak, at, rows = live_at_peak(snap, args.device)
        print(f"{path}: peak {peak / 2**30:.3f} GiB of traced allocations at event {at}")
        for origin, count, nbytes in rows[: args.top]:
            print(f"  {nbytes / 2**30:8.3f} GiB  {count:5d}x  {origin}")


if __name__ == "__main__":
    main()
