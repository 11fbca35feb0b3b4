"""FP8 training (torchao's Float8Linear) under our fully_shard with CUDA tensors, against
FSDP2 + torchao on the GPU suite's backend: tensorwise and rowwise recipes, bf16 weight
gather, step by step in losses, gradients and parameters (tests/harness/fp8_workers.py)."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import fp8_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


def test_float8_linear_trains_like_fsdp2_with_torchao_gpu():
    missing = w.torchao_missing()
    if missing:
        pytest.skip(f"torchao does not import here: {missing}")
    report = run_distributed(w.float8_linear_parity, WORLD, ["tensorwise", "rowwise"], **GPU, timeout=300)[0]
    assert set(report) == {"tensorwise", "rowwise"}
