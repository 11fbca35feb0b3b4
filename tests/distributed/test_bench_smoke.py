"""The benchmark scripts run end to end (CPU + Gloo, tiny config). A functional check
only: timings are measured on the GPU machine and recorded in benchmarks/RESULTS.md."""
import json
from pathlib import Path

import pytest

from megatron_fsdp_ext.testing.launcher import run_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name):
    if not (BENCH / name).exists():
        pytest.skip("benchmarks/ is not part of this checkout")
    return BENCH / name


def test_bench_train_tiny_cpu(tmp_path):
    run_script(2, _script("bench_train.py"), "--device", "cpu", "--configs", "tiny", "--steps", "2",
               "--warmup", "1", "--out", str(tmp_path), port=29571)
    data = json.loads((tmp_path / "results.json").read_text())
    systems = {r["system"] for r in data["results"]}
    assert systems == {"mfsdp", "fsdp2", "ddp"}
    losses = {r["system"]: r["final_loss"] for r in data["results"]}
    # Same model, seed and data: the three systems train alike (fp32 on CPU).
    assert max(losses.values()) - min(losses.values()) < 1e-3, losses
    assert "| tiny | mfsdp |" in (tmp_path / "results.md").read_text()


def test_bench_layerwise_tiny_cpu(tmp_path):
    run_script(2, _script("bench_layerwise.py"), "--device", "cpu", "--config", "tiny", "--steps", "2",
               "--warmup", "1", "--out", str(tmp_path), port=29572)
    data = json.loads((tmp_path / "layerwise.json").read_text())
    assert [r["system"] for r in data["results"]] == ["replicated", "layerwise_sync", "layerwise_overlap"]
    losses = [r["final_loss"] for r in data["results"]]
    # The same Muon + AdamW math, distributed three ways (fp32 on CPU).
    assert max(losses) - min(losses) < 1e-4, losses
