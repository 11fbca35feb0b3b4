"""FP8 training with torchao's Float8Linear under our fully_shard: tensorwise and rowwise
recipes against FSDP2 + torchao (same recipe, seed and data; bf16 weight gather), step by
step in losses, gradients and parameters, on Gloo world 2. .ci/run installs torchao."""
import pytest

from harness import run_distributed
from harness import fp8_workers as w

_MISSING = w.torchao_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchao does not import here: {_MISSING}")


def test_float8_linear_trains_like_fsdp2_with_torchao():
    report = run_distributed(w.float8_linear_parity, 2, ["tensorwise", "rowwise"], timeout=300)[0]
    assert set(report) == {"tensorwise", "rowwise"}


def test_fsdp2_gather_extension_is_refused_by_name():
    run_distributed(w.float8_gather_extension_refused, 2, timeout=120)
