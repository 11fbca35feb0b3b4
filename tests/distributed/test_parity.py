"""Multi-process (Gloo) parity against a single-process reference: same seed, same data."""
import pytest

from megatron_fsdp_ext.testing import run_distributed
from megatron_fsdp_ext.testing.workers import PARITY_SCENARIOS, train_parity, train_tiny_parity

SCENARIOS = PARITY_SCENARIOS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_train_parity(name, world):
    opts = dict(SCENARIOS[name], steps=5)
    results = run_distributed(train_parity, world, opts, timeout=240)
    r0 = results[0]
    # Every rank saw the same global losses.
    assert all(r["losses"] == r0["losses"] for r in results)
    assert len(r0["losses"]) == 5


def test_all_features_together_world4():
    opts = {"tie": True, "unused": True, "frozen": True, "micro_batches": 2, "clip": 0.05, "steps": 5}
    run_distributed(train_parity, 4, opts, timeout=240)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_world_sizes_and_odd_params(world):
    errs = run_distributed(train_tiny_parity, world, {}, timeout=180)
    assert max(errs) <= 1e-6


def test_world_one_transformer():
    run_distributed(train_parity, 1, {"steps": 3, "tie": True}, timeout=180)
