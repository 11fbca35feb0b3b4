"""Multi-process (Gloo) parity against a single-process reference: same seed, same data."""
import pytest
import torch

from megatron_fsdp_ext.testing import run_distributed
from megatron_fsdp_ext.testing.workers import train_parity, train_tiny_parity

SCENARIOS = {
    "adamw": {},
    "sgd": {"optimizer": "sgd"},
    "tied": {"tie": True},
    "unused_params": {"unused": True},
    "frozen_params": {"frozen": True},
    "grad_accumulation": {"micro_batches": 2},
    "grads_accumulate_across_synced_backwards": {"micro_batches": 2, "sync_every_micro": True},
    "clip_grad_norm": {"clip": 0.05},
    "no_reshard_after_forward": {"reshard_after_forward": False},
    # bf16 compute vs an fp32 reference: losses within bf16 tolerance, and every
    # parameter's error a small fraction of how far it moved (lr 1e-3 so it moves).
    "bf16_mixed_precision": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
        "lr": 1e-3, "loss_tol": 1e-2, "param_tol_of_update": 0.15,
    },
    "bf16_reduce": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16,
        "lr": 1e-3, "loss_tol": 1e-2, "param_tol_of_update": 0.15,
    },
}


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
