"""FP8 numerics: the example model (examples/train_gpt.py) trained three ways from the same
seed and data, each in its own torchrun job: bf16 (no FP8), FP8 matmuls with the weights
gathered in bf16 (torchao Float8Linear, tensorwise), and FP8 matmuls with the weights
gathered in FP8 (our gather transform). Writes the loss curves (JSON and PNG) and the
differences against bf16.

    python benchmarks/fp8_numerics.py --nproc 1 --steps 200 --out runs/fp8_numerics
    python benchmarks/fp8_numerics.py --nproc 2 --steps 5 --d-model 64 --out /tmp/fp8n   # CPU smoke
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

MODES = ("none", "tensorwise", "tensorwise_gather")
LABELS = {"none": "bf16", "tensorwise": "FP8, bf16 gather", "tensorwise_gather": "FP8, FP8 gather"}
ROOT = Path(__file__).resolve().parent.parent


def run(mode: str, args) -> dict:
    out = Path(args.out) / f"metrics_{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           f"--master_port={args.port}", str(ROOT / "examples" / "train_gpt.py"), "--steps", str(args.steps),
           "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--fp8", mode,
           "--out-dir", str(Path(args.work or args.out) / mode), "--metrics-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return json.loads(out.read_text())


def smooth(xs, k: int):
    return [sum(xs[max(0, i - k + 1): i + 1]) / len(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--port", type=int, default=29651)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="runs/fp8_numerics")
    p.add_argument("--work", default="", help="where each run's checkpoint and plot go (default: --out)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    curves = {m: run(m, args)["losses"] for m in MODES}
    base = curves["none"]
    window = max(1, min(50, args.steps // 4))
    summary = {}
    for m in MODES:
        c = curves[m]
        diffs = [abs(a - b) for a, b in zip(smooth(c, 10), smooth(base, 10))]
        summary[m] = {
            "finite": all(math.isfinite(v) for v in c),
            "first": c[0], "last": c[-1],
            f"mean_last_{window}": sum(c[-window:]) / window,
            "max_abs_diff_vs_bf16_smoothed10": max(diffs),
            f"mean_diff_vs_bf16_last_{window}": sum(c[-window:]) / window - sum(base[-window:]) / window,
        }
    g = curves["tensorwise_gather"], curves["tensorwise"]
    summary["fp8_gather_vs_bf16_gather_max_abs_diff_raw"] = max(abs(a - b) for a, b in zip(*g))
    import torch
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "commit": os.environ.get("MFSDP_COMMIT"), "config": vars(args)}
    (Path(args.out) / "fp8_numerics.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "losses": curves}, indent=1))
    print(json.dumps(summary, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for m in MODES:
        ax.plot(curves[m], lw=1.0, label=LABELS[m])
        if m != "none":
            bx.plot([a - b for a, b in zip(smooth(curves[m], 10), smooth(base, 10))], lw=1.0, label=LABELS[m])
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"train_gpt, {meta['device']}")
    bx.set(xlabel="step", ylabel="loss - bf16 loss (10-step mean)", title="difference against bf16")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out) / "fp8_numerics.png")


if __name__ == "__main__":
    main()
