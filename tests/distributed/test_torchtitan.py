"""torchtitan 0.3.0's own parallelize code on our fully_shard (swapped in for torch's, the
only change): apply_fsdp_to_decoder at Gloo world 2, and parallelize_llama with tensor
parallel 2 x FSDP 2 at world 4, each training its Llama3 debugmodel like one plain process.
.ci/run installs torchtitan without its heavy extras (no triton, no torchdata)."""
import pytest

from harness import run_distributed
from harness import titan_workers as w

_MISSING = w.available()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchtitan does not import here: {_MISSING}")


def test_torchtitan_apply_fsdp_to_decoder():
    worst = run_distributed(w.titan_apply_fsdp, 2, timeout=300)[0]
    assert worst["param"] <= 1e-4


def test_torchtitan_parallelize_llama_with_tp():
    worst = run_distributed(w.titan_parallelize_llama, 4, 2, timeout=300)[0]
    assert worst["param"] <= 1e-4
