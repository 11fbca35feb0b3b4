"""Prefetch engine on Gloo: runtime order, bounded unsharded units, explicit targets,
contexts per root, and parity with prefetching and a separate all-gather communicator."""
import pytest

from megatron_fsdp_ext.testing import run_distributed
from megatron_fsdp_ext.testing.workers import prefetch_semantics, train_parity


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_order_bound_and_parity(depth):
    live = run_distributed(prefetch_semantics, 2, depth, timeout=180)[0]
    assert live["fwd"] <= 1 + depth


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_separate_all_gather_group(world):
    run_distributed(train_parity, world, {"create_all_gather_group": True, "steps": 5}, timeout=240)


def test_parity_prefetch_depth_2_with_accumulation():
    run_distributed(train_parity, 2, {"prefetch_depth": 2, "micro_batches": 2, "steps": 5}, timeout=240)
