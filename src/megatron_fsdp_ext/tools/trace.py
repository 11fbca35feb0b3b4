"""Reading GPU kernel intervals out of a torch.profiler chrome trace, for the overlap
tests and the benchmark's timeline plot."""
from __future__ import annotations

import json
import re
from typing import Dict, List, Tuple

Kernel = Tuple[str, object, float, float]  # (name, stream, start_us, end_us)


def kernel_intervals(trace_path: str) -> List[Kernel]:
    """(name, stream, start_us, end_us) of every GPU kernel in a chrome trace."""
    with open(trace_path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and "dur" in e:
            out.append((e["name"], e.get("args", {}).get("stream"), float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return out


def copy_intervals(trace_path: str) -> List[Kernel]:
    """(name, stream, start_us, end_us) of every GPU memory copy in a chrome trace; the name
    says the direction and the host memory, e.g. "Memcpy HtoD (Pinned -> Device)"."""
    with open(trace_path) as f:
        trace = json.load(f)
    return [(e["name"], e.get("args", {}).get("stream"), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in trace.get("traceEvents", []) if e.get("cat") == "gpu_memcpy" and "dur" in e]


def nccl_kernel_summary(trace_path: str) -> Dict[str, Dict]:
    """Per NCCL collective in a chrome trace (AllGather, ReduceScatter, AllReduce, SendRecv):
    its kernels, their summed time in ms and the largest grid. An NCCL kernel runs one
    block per channel, each on an SM of its own, so the grid is the SMs the collective
    takes from compute. A kernel's time includes waiting for its peers."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    summary: Dict[str, Dict] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "kernel" or "dur" not in e or not name.startswith("nccl"):
            continue
        # ncclDevKernel_AllGather_RING_LL(...), ncclSymkDevKernel_...
        kind = re.sub(r"^nccl[A-Za-z]*Kernel_", "", name).split("_")[0].split("(")[0]
        s = summary.setdefault(kind, {"kernels": 0, "total_ms": 0.0, "max_grid_blocks": 0})
        s["kernels"] += 1
        s["total_ms"] += float(e["dur"]) / 1e3
        grid = e.get("args", {}).get("grid") or [0]
        blocks = 1
        for g in grid:
            blocks *= int(g)
        s["max_grid_blocks"] = max(s["max_grid_blocks"], blocks)
    return summary


def overlapping(a: Kernel, others: List[Kernel]) -> bool:
    """Whether kernel `a` runs at the same time as any kernel of another stream."""
    return any(o[1] != a[1] and o[2] < a[3] and a[2] < o[3] for o in others)


def covered_fraction(a: Kernel, others: List[Kernel]) -> float:
    """The fraction of kernel `a`'s duration during which at least one of `others` runs
    on another stream (overlapping intervals of `others` are merged, not double-counted)."""
    duration = a[3] - a[2]
    if duration <= 0:
        return 0.0
    clipped = [(o[0], o[1], max(o[2], a[2]), min(o[3], a[3]))
               for o in others if o[1] != a[1] and o[2] < a[3] and a[2] < o[3]]
    return union_length(clipped) / duration


def union_length(kernels: List[Kernel]) -> float:
    """Microseconds during which at least one of `kernels` runs."""
    total, reach = 0.0, float("-inf")
    for _, _, start, end in sorted(kernels, key=lambda k: k[2]):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def kernel_kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        if "allgather" in low:
            return "all-gather"
        if "reducescatter" in low:
            return "reduce-scatter"
        if "allreduce" in low:
            return "all-reduce"
        return "other collective"
    return "compute"


def is_marker(kernel: Kernel) -> bool:
    """`torch.cuda._sleep` kernels, which the overlap tests use as phase markers."""
    return "spin" in kernel[0].lower()


def step_overlap(kernels: List[Kernel], min_fraction: float = 0.5) -> Dict:
    """Per-kernel overlap of one training step delimited by three marker kernels on the
    compute stream: begin (before forward), boundary (between forward and backward) and
    end (after backward returned). Collectives count as overlapped when compute-stream
    kernels run during at least `min_fraction` of their duration; non-NCCL kernels on the
    side streams (casts, gradient scaling) are not compute. Returns counts, per-kernel
    fractions and durations (ms)."""
    markers = sorted((k for k in kernels if is_marker(k)), key=lambda k: k[2])
    if len(markers) != 3:
        raise ValueError(f"expected 3 marker kernels (begin, forward/backward boundary, end), found {len(markers)}")
    if len({m[1] for m in markers}) != 1:
        raise ValueError(f"the marker kernels ran on different streams {[m[1] for m in markers]}: "
                         "launch them on the compute stream")
    begin, boundary, end = markers
    compute_stream = begin[1]
    compute = [k for k in kernels if k[1] == compute_stream and not is_marker(k)]
    collectives = [k for k in kernels if kernel_kind(k[0]) != "compute"]
    step = [k for k in collectives if k[2] >= begin[3] and k[3] <= end[2]]
    fwd = [k for k in step if k[3] <= boundary[2]]
    bwd = [k for k in step if k[2] >= boundary[3]]
    fwd_ag = [k for k in fwd if kernel_kind(k[0]) == "all-gather"]
    bwd_ag = [k for k in bwd if kernel_kind(k[0]) == "all-gather"]
    rs = [k for k in bwd if kernel_kind(k[0]) == "reduce-scatter"]
    # The units' agreement on which parameters got gradients (Unit::agree_on_grads).
    bwd_ar = [k for k in bwd if kernel_kind(k[0]) == "all-reduce"]
    fwd_compute = [k for k in compute if begin[3] <= k[2] and k[3] <= boundary[2]]

    def fractions(group, against):
        return [round(covered_fraction(k, against), 3) for k in group]

    def ms(group):
        return [round((k[3] - k[2]) / 1e3, 3) for k in group]

    stats = {
        "fwd_all_gathers": len(fwd_ag),
        "bwd_all_gathers": len(bwd_ag),
        "reduce_scatters": len(rs),
        # Collectives of the step that straddle the boundary marker, or of another kind.
        "bwd_all_reduces": len(bwd_ar),
        "unclassified_collectives": len(step) - len(fwd_ag) - len(bwd_ag) - len(rs) - len(bwd_ar),
        "fwd_compute_ms": round(union_length(fwd_compute) / 1e3, 3),
        "fwd_all_gather_ms": ms(fwd_ag),
        "bwd_all_gather_ms": ms(bwd_ag),
        "reduce_scatter_ms": ms(rs),
        "fwd_all_gather_covered_by_compute": fractions(fwd_ag, compute),
        "bwd_all_gather_covered_by_compute": fractions(bwd_ag, compute),
        "reduce_scatter_covered_by_compute": fractions(rs, compute),
        "bwd_all_gather_covered_by_reduce_scatter": fractions(bwd_ag, rs),
    }
    counted = {
        "fwd_all_gathers_overlapped": "fwd_all_gather_covered_by_compute",
        "bwd_all_gathers_overlapped": "bwd_all_gather_covered_by_compute",
        "reduce_scatters_overlapped": "reduce_scatter_covered_by_compute",
        "bwd_all_gathers_beside_reduce_scatters": "bwd_all_gather_covered_by_reduce_scatter",
    }
    for name, key in counted.items():
        stats[name] = sum(f >= min_fraction for f in stats[key])
    return stats


def plot_timeline(kernels: List[Kernel], path: str, title: str) -> None:
    """One lane per CUDA stream; kernels coloured by kind (compute, all-gather, reduce-scatter)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not kernels:
        return
    t0 = min(k[2] for k in kernels)
    streams = sorted({k[1] for k in kernels}, key=str)
    colours = {"compute": "tab:blue", "all-gather": "tab:orange", "reduce-scatter": "tab:green",
               "other collective": "tab:red"}
    fig, ax = plt.subplots(figsize=(14, 1 + 0.5 * len(streams)), dpi=120)
    for lane, stream in enumerate(streams):
        for kind, colour in colours.items():
            spans = [((k[2] - t0) / 1e3, (k[3] - k[2]) / 1e3) for k in kernels
                     if k[1] == stream and kernel_kind(k[0]) == kind]
            if spans:
                ax.broken_barh(spans, (lane - 0.4, 0.8), color=colour)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
