"""The benchmark scripts run end to end (CPU + Gloo, tiny config). A functional check
only: timings are measured on the GPU machine and recorded in benchmarks/RESULTS.md."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_tiny_cpu(tmp_path):
    script = ROOT / "benchmarks" / "bench_train.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not part of this checkout")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29571",
           str(script), "--device", "cpu", "--configs", "tiny", "--steps", "2", "--warmup", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    systems = {r["system"] for r in data["results"]}
    assert systems == {"mfsdp", "fsdp2", "ddp"}
    losses = {r["system"]: r["final_loss"] for r in data["results"]}
    # Same model, seed and data: the three systems train alike (fp32 on CPU).
    assert max(losses.values()) - min(losses.values()) < 1e-3, losses
    assert "| tiny | mfsdp |" in (tmp_path / "results.md").read_text()


def test_bench_layerwise_tiny_cpu(tmp_path):
    script = ROOT / "benchmarks" / "bench_layerwise.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not part of this checkout")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29572",
           str(script), "--device", "cpu", "--config", "tiny", "--steps", "2", "--warmup", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "layerwise.json").read_text())
    assert [r["system"] for r in data["results"]] == ["replicated", "layerwise_sync", "layerwise_overlap"]
    losses = [r["final_loss"] for r in data["results"]]
    # The same Muon + AdamW math, distributed three ways (fp32 on CPU).
    assert max(losses) - min(losses) < 1e-4, losses
