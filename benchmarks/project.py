"""A projection, not a measurement: step time at world W from the simulator's measured
compute (benchmarks/simulate.py: one GPU, fake backend, no communication) plus the
communication a stated alpha-beta model says stays exposed.

    python benchmarks/project.py benchmarks/data/simulate_fake_h100_*.json --out runs/projection
    python benchmarks/project.py SIM.json --link LINK_PROBE.json --measured COMPARE_ROWS.json ...

With --link (a benchmarks/link_probe.py JSON measured at world W on the machine the
projection is for), W <= 8 uses alpha and busbw fitted by least squares to that probe's
timed all-gathers (1-64 MiB) instead of run G's two points; reduce-scatters are assumed to
run at the all-gather's rate (run G: within 7% of each other at 16 and 256 MiB). With
--measured (bench_train.py / compare_systems.py output: rows, or {"rows"|"results"|
"defaults_rows": rows}, or {"runs": {name: results.json}}), every projection whose
(system, config, world) was measured is checked against the median measured step.

Model (all parameters printed with the table):
  - a collective over a buffer of B bytes at world W takes alpha + B (W-1)/W / busbw
    (busbw as nccl-tests defines it; B = all-gather output / reduce-scatter input);
  - W <= 8 (one NVLink node): alpha and busbw fitted to run G's all-gathers and
    reduce-scatters of 16 and 256 MiB on 2xH200 (benchmarks/RESULTS.md);
  - W > 8 (InfiniBand between nodes, assumed, not measured here): 45 GB/s bus bandwidth
    per GPU (a 400 Gb/s NIC per GPU at ~90%) and a latency that grows with the number of
    nodes a ring crosses;
  - units are the blocks plus the root (embedding, final norm, head); each block's share
    of the measured forward and backward time is 1/L of it; where the simulator counted a
    system's collectives (ours: its own counters; FSDP2: the c10d calls), the blocks'
    collectives are that many per phase instead of one per block (our buckets), each
    carrying its share of the bytes and hiding behind its share of the compute;
  - prefetch depth 1: in forward the next block's all-gather hides behind this block's
    compute; in backward the previous block's all-gather and this block's
    reduce-scatter share the link and hide behind this block's backward; the root's
    gather, and the last reduce-scatters, are exposed.
  - a collective running beside compute takes its grid's SMs from it: the compute that
    overlaps communication runs on the remaining SMs, so each phase's compute grows by
    --comm-sm-share times the communication it hides (at most its own compute), and
    that longer compute hides as much more of the communication. The
    default, 24 of the H200's 132 SMs, is the grid NCCL 2.28.9 gave every all-gather and
    reduce-scatter at worlds 2 and 4 in RESULTS 16 (0 turns the term off).
Exposed communication per phase = sum over units of max(0, communication - compute it
hides behind). Projected step = measured step + exposed forward + exposed backward + the
compute lost to the collectives' SMs.
Not modelled: the memory bandwidth collectives take, CPU launch cost, stragglers,
contention with other jobs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate import parse_config  # noqa: E402

MIB = 2**20
# Run G (2xH200, NCCL 2.28, comm_world2_h200_runG.json), medians: all-gather 16 MiB
# 0.069 ms, 256 MiB 0.565 ms; reduce-scatter 0.066 and 0.607 ms.
RUN_G = {"all_gather": ((16, 0.069), (256, 0.565)), "reduce_scatter": ((16, 0.066), (256, 0.607))}
IB_BUSBW_GBPS = 45.0
# RESULTS 16: every NCCL all-gather and reduce-scatter ran on a grid of 24 blocks (one SM
# each) at worlds 2 and 4 on H200, which has 132 SMs.
COMM_SM_SHARE = 24 / 132


def fit_nvlink(points, world=2):
    """alpha (ms) and busbw (GB/s) through two (MiB, ms) points measured at `world`."""
    (m1, t1), (m2, t2) = points
    frac = (world - 1) / world
    b1, b2 = m1 * MIB * frac, m2 * MIB * frac
    busbw = (b2 - b1) / ((t2 - t1) * 1e-3) / 1e9
    alpha = t1 - b1 / (busbw * 1e9) * 1e3
    return alpha, busbw


NVLINK = {kind: fit_nvlink(points) for kind, points in RUN_G.items()}


def fit_probe(path: str) -> dict:
    """{kind: (alpha ms, busbw GB/s)} by least squares through a link_probe.py JSON's timed
    all-gathers (bytes = all-gather output), for both kinds of collective."""
    data = json.loads(Path(path).read_text())
    world = data["meta"]["world"]
    points = [(c["bytes"] * (world - 1) / world, c["measured_s"] * 1e3) for c in data["checks"]]
    if len(points) < 2:
        raise SystemExit(f"--link {path}: needs at least two timed all-gathers, found {len(points)}")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    alpha, busbw = my - slope * mx, 1e-6 / slope  # slope: ms per byte
    return {"all_gather": (alpha, busbw), "reduce_scatter": (alpha, busbw), "source": path, "world": world}


def link(kind: str, world: int, nvlink: dict = None):
    """(alpha ms, busbw GB/s) of the model at `world`."""
    nvlink = nvlink or NVLINK
    if world <= 8:
        return nvlink[kind]
    nodes = world // 8
    return nvlink[kind][0] + 0.02 + 0.002 * nodes, IB_BUSBW_GBPS


def collective_ms(kind: str, nbytes: float, world: int, nvlink: dict = None) -> float:
    alpha, busbw = link(kind, world, nvlink)
    return alpha + nbytes * (world - 1) / world / (busbw * 1e9) * 1e3


def collectives_per_phase(row: dict, layers: int):
    """(all-gathers, reduce-scatters) over the blocks in one phase, from the simulator's
    counts where it has them (all-gathers run in forward and again in backward; the
    root's one of each is left out), else one per block."""
    counts = row.get("our_counts_per_step") or {}
    if counts.get("all_gather") and counts.get("reduce_scatter"):
        ag, rs = counts["all_gather"][0], counts["reduce_scatter"][0]
    else:
        calls = row.get("c10d_calls_per_step") or {}
        ag = sum(v[0] for k, v in calls.items() if "allgather" in k and isinstance(v, list))
        rs = sum(v[0] for k, v in calls.items() if "reduce_scatter" in k and isinstance(v, list))
    if not ag or not rs:
        return layers, layers
    return max(1, min(layers, round((ag - 2) / 2))), max(1, min(layers, rs - 1))


def unit_sizes(config: str):
    """(root numel, block numel, layers) of a simulate.py config."""
    vocab, d, layers, heads, ffn, mb, seq = parse_config(config)
    block = 4 * d * d + 3 * d * ffn + 2 * d  # wqkv + wo, gate/up + down, two norms
    root = 2 * vocab * d + d  # embedding, head, final norm
    return root, block, layers


def project(row: dict, param_bytes: int = 2, grad_bytes: int = 4, nvlink: dict = None,
            sm_share: float = COMM_SM_SHARE) -> dict:
    world = row["world"]
    root, block, layers = unit_sizes(row["config"])
    n_ag, n_rs = collectives_per_phase(row, layers)
    ag_root = collective_ms("all_gather", root * param_bytes, world, nvlink)
    ag = collective_ms("all_gather", block * layers / n_ag * param_bytes, world, nvlink)
    rs = collective_ms("reduce_scatter", block * layers / n_rs * grad_bytes, world, nvlink)
    rs_root = collective_ms("reduce_scatter", root * grad_bytes, world, nvlink)
    # Ours all-reduces a few bytes before each reduction (which parameters got gradients,
    # Unit::agree_on_grads) on the same stream: one more latency per reduce-scatter.
    if (row.get("our_counts_per_step") or {}).get("all_reduce"):
        mask = link("all_gather", world, nvlink)[0]
        rs, rs_root = rs + mask, rs_root + mask
    # Forward: the root's gather and the first block gather are exposed; the rest hide
    # behind the compute before them. Backward: each later all-gather and every
    # reduce-scatter but the last share the link and hide behind the backward compute;
    # the last reduce-scatter and the root's are exposed. Uniform shares: the sum over
    # shares of max(0, communication - compute) is max(0, total communication - compute).
    hidden_fwd, hideable_fwd = (n_ag - 1) * ag, row["forward_ms"] * (n_ag - 1) / n_ag
    hidden_bwd, hideable_bwd = (n_ag - 1) * ag + (n_rs - 1) * rs, row["backward_ms"] * (n_rs - 1) / n_rs
    # The compute that ran beside a collective did so on 1 - sm_share of the SMs: it takes
    # longer, and the longer compute hides more of the communication (a phase bound by the
    # link loses nothing to the SMs until the slowed compute outlasts the link).
    lost_fwd = sm_share * min(hidden_fwd, hideable_fwd)
    lost_bwd = sm_share * min(hidden_bwd, hideable_bwd)
    exposed_fwd = ag_root + ag + max(0.0, hidden_fwd - hideable_fwd - lost_fwd)
    exposed_bwd = rs + rs_root + max(0.0, hidden_bwd - hideable_bwd - lost_bwd)
    sm_loss = lost_fwd + lost_bwd
    return {"system": row["system"], "config": row["config"], "world": world, "measured_compute_ms": row["step_ms"],
            "gathers_per_phase": n_ag, "reduce_scatters": n_rs,
            "all_gather_ms_each": ag, "reduce_scatter_ms_each": rs, "exposed_forward_ms": exposed_fwd,
            "exposed_backward_ms": exposed_bwd, "compute_lost_to_comm_sms_ms": sm_loss,
            "projected_step_ms": row["step_ms"] + exposed_fwd + exposed_bwd + sm_loss}


def load_measured(paths, default_world=None) -> dict:
    """{(system, config, world): [step ms, ...]} from bench_train / compare_systems output
    (`default_world` where a file does not say its world: compare_systems' rows)."""
    found = {}

    def add(rows, world=None):
        for r in rows:
            if "error" in r or "step_s" not in r and "step_ms" not in r:
                continue
            ms = r["step_ms"] if "step_ms" in r else r["step_s"] * 1e3
            w = r.get("world") or world
            found.setdefault((r["system"], r["config"], w), []).append(ms)

    for path in paths:
        data = json.loads(Path(path).read_text())
        if isinstance(data, list):
            add(data, default_world)
            continue
        world = (data.get("meta") or {}).get("world") or data.get("world") or default_world
        for key in ("rows", "results", "defaults_rows"):
            if key in data:
                add(data[key], world)
        for run in (data.get("runs") or {}).values():
            add(run.get("results", []), (run.get("meta") or {}).get("world"))
    return found


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
    p.add_argument("--link", help="a link_probe.py JSON: fit the W <= 8 link to it instead of run G")
    p.add_argument("--measured", nargs="*", default=[], help="bench_train / compare_systems JSON to check against")
    p.add_argument("--measured-world", type=int, help="the world of --measured files that do not record it")
    p.add_argument("--comm-sm-share", type=float, default=COMM_SM_SHARE,
                   help="the share of the GPU's SMs a collective takes from the compute beside it (0: none)")
    p.add_argument("--out", default="runs/projection")
    args = p.parse_args()
    if not 0.0 <= args.comm_sm_share < 1.0:
        raise SystemExit(f"--comm-sm-share {args.comm_sm_share}: must be in [0, 1)")
    rows = []
    for f in args.files:
        data = json.loads(Path(f).read_text())
        rows += data["rows"] if isinstance(data, dict) else data
    rows = [r for r in rows if "error" not in r and r["system"] in ("mfsdp", "fsdp2")]
    nvlink = fit_probe(args.link) if args.link else NVLINK
    source = f"fitted to {args.link} (world {nvlink['world']})" if args.link else "fitted to run G (2xH200)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["Model parameters: " + "; ".join(f"{k} NVLink alpha {nvlink[k][0]:.3f} ms busbw {nvlink[k][1]:.1f} GB/s"
                                               for k in ("all_gather", "reduce_scatter"))
             + f" ({source}); W > 8: busbw {IB_BUSBW_GBPS} GB/s, alpha + 0.02 ms + 0.002 ms per node; "
             + f"collectives take {args.comm_sm_share:.3f} of the SMs from the compute beside them", "",
             "| config | W | system | measured compute ms | gathers / reduce-scatters per phase | AG / RS ms each | "
             "exposed fwd ms | exposed bwd ms | compute lost to comm SMs ms | projected step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    projections = []
    for r in rows:
        if "/" in r["config"]:
            continue  # depth-reduced copies: their own projection adds nothing
        pr = project(r, nvlink=nvlink, sm_share=args.comm_sm_share)
        projections.append(pr)
        lines.append(f"| {r['config']} | {r['world']} | {r['system']} | {pr['measured_compute_ms']:.1f} | "
                     f"{pr['gathers_per_phase']} / {pr['reduce_scatters']} | "
                     f"{pr['all_gather_ms_each']:.2f} / {pr['reduce_scatter_ms_each']:.2f} | "
                     f"{pr['exposed_forward_ms']:.1f} | {pr['exposed_backward_ms']:.1f} | "
                     f"{pr['compute_lost_to_comm_sms_ms']:.1f} | {pr['projected_step_ms']:.1f} |")
    checks = []
    measured = load_measured(args.measured, args.measured_world)
    if measured:
        lines += ["", "Check against the measured steps (--measured; median of the runs, min-max):", "",
                  "| config | W | system | projected ms | measured ms | runs | error |", "|---|---|---|---|---|---|---|"]
        for pr in projections:
            steps = measured.get((pr["system"], pr["config"], pr["world"]))
            if not steps:
                continue
            med = statistics.median(steps)
            err = pr["projected_step_ms"] / med - 1
            checks.append({"system": pr["system"], "config": pr["config"], "world": pr["world"],
                           "projected_ms": pr["projected_step_ms"], "measured_ms": med, "measured_runs": steps,
                           "error": err})
            lines.append(f"| {pr['config']} | {pr['world']} | {pr['system']} | {pr['projected_step_ms']:.1f} | "
                         f"{med:.1f} ({min(steps):.1f}-{max(steps):.1f}) | {len(steps)} | {err:+.0%} |")
    else:
        lines += ["", "Check against run E (2xH200, NCCL, W=2, measured):", "",
                  "| config | system | compute (H100 sim, W=8) ms | projected W=2 ms | measured W=2 ms | error |",
                  "|---|---|---|---|---|---|"]
        for (system, config), step in RUN_E.items():
            src = next((r for r in rows if r["system"] == system and r["config"] == config), None)
            if src is None:
                continue
            pr = project(dict(src, world=2), nvlink=nvlink, sm_share=args.comm_sm_share)
            err = pr["projected_step_ms"] / step - 1
            checks.append({"system": system, "config": config, "projected_ms": pr["projected_step_ms"],
                           "measured_ms": step, "error": err})
            lines.append(f"| {config} | {system} | {src['step_ms']:.1f} | {pr['projected_step_ms']:.1f} | {step:.1f} | "
                         f"{err:+.0%} |")
    text = "\n".join(lines)
    print(text)
    (out / "projection.md").write_text(text + "\n")
    (out / "projection.json").write_text(json.dumps({"nvlink": nvlink, "ib_busbw_gbps": IB_BUSBW_GBPS,
                                                     "comm_sm_share": args.comm_sm_share,
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
    if not configs:  # one world per config: nothing to draw against W
        return
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
