"""A projection, not a measurement: step time at world W from the simulator's measured
compute (benchmarks/simulate.py: one GPU, fake backend, no communication) plus the
communication a stated alpha-beta model says stays exposed.

    python benchmarks/project.py benchmarks/data/simulate_fake_h100_*.json --out runs/projection

Model (all parameters printed with the table):
  - a collective over a buffer of B bytes at world W takes alpha + B (W-1)/W / busbw
    (busbw as nccl-tests defines it; B = all-gather output / reduce-scatter input);
  - W <= 8 (one NVLink node): alpha and busbw fitted to run G's all-gathers and
    reduce-scatters of 16 and 256 MiB on 2xH200 (benchmarks/RESULTS.md);
  - W > 8 (InfiniBand between nodes, assumed, not measured here): 45 GB/s bus bandwidth
    per GPU (a 400 Gb/s NIC per GPU at ~90%) and a latency that grows with the number of
    nodes a ring crosses;
  - units are the blocks plus the root (embedding, final norm, head); each block's share
    of the measured forward and backward time is 1/L of it;
  - prefetch depth 1: in forward the next block's all-gather hides behind this block's
    compute; in backward the previous block's all-gather and this block's
    reduce-scatter share the link and hide behind this block's backward; the root's
    gather, and the last reduce-scatters, are exposed.
Exposed communication per phase = sum over units of max(0, communication - compute it
hides behind). Projected step = measured step + exposed forward + exposed backward.
Not modelled: collectives slowing compute (SMs and memory bandwidth they take), CPU
launch cost, stragglers, contention with other jobs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate import parse_config  # noqa: E402

MIB = 2**20
# Run G (2xH200, NCCL 2.28, comm_world2_h200_runG.json), medians: all-gather 16 MiB
# 0.069 ms, 256 MiB 0.565 ms; reduce-scatter 0.066 and 0.607 ms.
RUN_G = {"all_gather": ((16, 0.069), (256, 0.565)), "reduce_scatter": ((16, 0.066), (256, 0.607))}
IB_BUSBW_GBPS = 45.0


def fit_nvlink(points, world=2):
    """alpha (ms) and busbw (GB/s) through two (MiB, ms) points measured at `world`."""
    (m1, t1), (m2, t2) = points
    frac = (world - 1) / world
    b1, b2 = m1 * MIB * frac, m2 * MIB * frac
    busbw = (b2 - b1) / ((t2 - t1) * 1e-3) / 1e9
    alpha = t1 - b1 / (busbw * 1e9) * 1e3
    return alpha, busbw


NVLINK = {kind: fit_nvlink(points) for kind, points in RUN_G.items()}


def link(kind: str, world: int):
    """(alpha ms, busbw GB/s) of the model at `world`."""
    if world <= 8:
        return NVLINK[kind]
    nodes = world // 8
    return NVLINK[kind][0] + 0.02 + 0.002 * nodes, IB_BUSBW_GBPS


def collective_ms(kind: str, nbytes: float, world: int) -> float:
    alpha, busbw = link(kind, world)
    return alpha + nbytes * (world - 1) / world / (busbw * 1e9) * 1e3


def unit_sizes(config: str):
    """(root numel, block numel, layers) of a simulate.py config."""
    vocab, d, layers, heads, ffn, mb, seq = parse_config(config)
    block = 4 * d * d + 3 * d * ffn + 2 * d  # wqkv + wo, gate/up + down, two norms
    root = 2 * vocab * d + d  # embedding, head, final norm
    return root, block, layers


def project(row: dict, param_bytes: int = 2, grad_bytes: int = 4) -> dict:
    world = row["world"]
    root, block, layers = unit_sizes(row["config"])
    ag_root = collective_ms("all_gather", root * param_bytes, world)
    ag = collective_ms("all_gather", block * param_bytes, world)
    rs = collective_ms("reduce_scatter", block * grad_bytes, world)
    rs_root = collective_ms("reduce_scatter", root * grad_bytes, world)
    fwd, bwd = row["forward_ms"] / layers, row["backward_ms"] / layers
    exposed_fwd = ag_root + ag + (layers - 1) * max(0.0, ag - fwd)
    exposed_bwd = (layers - 1) * max(0.0, ag + rs - bwd) + rs + rs_root
    return {"system": row["system"], "config": row["config"], "world": world, "measured_compute_ms": row["step_ms"],
            "all_gather_ms_per_block": ag, "reduce_scatter_ms_per_block": rs, "exposed_forward_ms": exposed_fwd,
            "exposed_backward_ms": exposed_bwd, "projected_step_ms": row["step_ms"] + exposed_fwd + exposed_bwd}


# Check against the 2xH200 NCCL rows of run E (benchmarks/RESULTS.md; measured step ms)
# that share a shape with a simulator config: run E "1b" is simulate "1.3b" (same
# model, micro-batch and sequence), "small_many" the same. The compute comes from the
# simulator's H100 rows at W=8 (one GPU, no communication): a different GPU and shard
# size, which is part of the stated error.
RUN_E = {("mfsdp", "1.3b"): 210.2, ("fsdp2", "1.3b"): 217.0, ("mfsdp", "small_many"): 202.8,
         ("fsdp2", "small_many"): 327.6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default="runs/projection")
    args = p.parse_args()
    rows = []
    for f in args.files:
        data = json.loads(Path(f).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    rows = [r for r in rows if "error" not in r and r["system"] in ("mfsdp", "fsdp2")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["Model parameters: " + "; ".join(f"{k} NVLink alpha {a:.3f} ms busbw {b:.1f} GB/s"
                                               for k, (a, b) in NVLINK.items())
             + f"; W > 8: busbw {IB_BUSBW_GBPS} GB/s, alpha + 0.02 ms + 0.002 ms per node", "",
             "| config | W | system | measured compute ms | AG/RS ms per block | exposed fwd ms | exposed bwd ms | "
             "projected step ms |", "|---|---|---|---|---|---|---|---|"]
    projections = []
    for r in rows:
        if "/" in r["config"]:
            continue  # depth-reduced copies: their own projection adds nothing
        pr = project(r)
        projections.append(pr)
        lines.append(f"| {r['config']} | {r['world']} | {r['system']} | {pr['measured_compute_ms']:.1f} | "
                     f"{pr['all_gather_ms_per_block']:.2f} / {pr['reduce_scatter_ms_per_block']:.2f} | "
                     f"{pr['exposed_forward_ms']:.1f} | {pr['exposed_backward_ms']:.1f} | "
                     f"{pr['projected_step_ms']:.1f} |")
    lines += ["", "Check against run E (2xH200, NCCL, W=2, measured):", "",
              "| config | system | compute (H100 sim, W=8) ms | projected W=2 ms | measured W=2 ms | error |",
              "|---|---|---|---|---|---|"]
    checks = []
    for (system, config), measured in RUN_E.items():
        src = next((r for r in rows if r["system"] == system and r["config"] == config), None)
        if src is None:
            continue
        pr = project(dict(src, world=2))
        err = pr["projected_step_ms"] / measured - 1
        checks.append({"system": system, "config": config, "projected_ms": pr["projected_step_ms"],
                       "measured_ms": measured, "error": err})
        lines.append(f"| {config} | {system} | {src['step_ms']:.1f} | {pr['projected_step_ms']:.1f} | {measured:.1f} | "
                     f"{err:+.0%} |")
    text = "\n".join(lines)
    print(text)
    (out / "projection.md").write_text(text + "\n")
    (out / "projection.json").write_text(json.dumps({"nvlink": NVLINK, "ib_busbw_gbps": IB_BUSBW_GBPS,
                                                     "projections": projections, "checks": checks}, indent=1))
    plot(rows, out / "simulate_peak_and_step.png")


def plot(rows, path: Path) -> None:
    """Per-rank steady peak and step time against W, ours vs FSDP2, per config."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    configs = sorted({r["config"] for r in rows if "/" not in r["config"] and
                      len({x["world"] for x in rows if x["config"] == r["config"]}) > 1})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for config in configs:
        for system, style in (("mfsdp", "-o"), ("fsdp2", "--s")):
            pts = sorted((r["world"], r) for r in rows if r["config"] == config and r["system"] == system)
            if not pts:
                continue
            ws = [w for w, _ in pts]
            axes[0].plot(ws, [r["steady_peak_gib"] for _, r in pts], style, label=f"{config} {system}")
            axes[1].plot(ws, [r["step_ms"] for _, r in pts], style, label=f"{config} {system}")
    for ax, ylabel in zip(axes, ("steady peak per rank (GiB)", "step time, no communication (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size W (fake backend, one H100)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("simulate.py: ours (mfsdp) vs FSDP2 per rank, measured on one H100")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
