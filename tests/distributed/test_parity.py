"""Multi-process (Gloo) parity: losses, full gradients at every step and parameters against
a reference on the same data (the single-process model; FSDP2 for bf16 mixed precision)."""
import pytest

from harness import run_distributed
from harness.workers import (PARITY_SCENARIOS, check_parity_results, train_parity,
                                              train_tiny_parity)

SCENARIOS = PARITY_SCENARIOS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_train_parity(name, world):
    opts = dict(SCENARIOS[name], steps=5)
    results = run_distributed(train_parity, world, opts, timeout=240)
    check_parity_results(results, steps=5)


def test_all_features_together_world4():
    opts = {"tie": True, "unused": True, "frozen": True, "micro_batches": 2, "clip": 0.05, "steps": 5}
    check_parity_results(run_distributed(train_parity, 4, opts, timeout=240), steps=5)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_world_sizes_and_odd_params(world):
    errs = run_distributed(train_tiny_parity, world, {}, timeout=180)
    assert max(errs) <= 1e-6


def test_world_one_transformer():
    check_parity_results(run_distributed(train_parity, 1, {"steps": 3, "tie": True}, timeout=180), steps=3)
