"""Reading GPU kernel intervals out of a torch.profiler chrome trace, for the overlap
tests and the benchmark's timeline plot."""
from __future__ import annotations

import json
from typing import List, Tuple

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


def overlapping(a: Kernel, others: List[Kernel]) -> bool:
    """Whether kernel `a` runs at the same time as any kernel of another stream."""
    return any(o[1] != a[1] and o[2] < a[3] and a[2] < o[3] for o in others)


def kernel_kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        if "allgather" in low:
            return "all-gather"
        if "reducescatter" in low:
            return "reduce-scatter"
        return "other collective"
    return "compute"


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
