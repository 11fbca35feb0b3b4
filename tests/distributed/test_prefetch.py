"""Prefetch engine on Gloo: runtime order, bounded unsharded units, explicit targets,
contexts per root, and parity with prefetching and a separate all-gather communicator."""
import pytest

from harness import run_distributed
from harness.workers import param_sync_modes, prefetch_semantics, train_parity, unsharded_memory_bound


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_order_bound_and_parity(depth):
    live = run_distributed(prefetch_semantics, 2, depth, timeout=180)[0]
    assert live["fwd"] <= 1 + depth


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_separate_all_gather_group(world):
    run_distributed(train_parity, world, {"create_all_gather_group": True, "steps": 5}, timeout=240)


def test_parity_prefetch_depth_2_with_accumulation():
    run_distributed(train_parity, 2, {"prefetch_depth": 2, "micro_batches": 2, "steps": 5}, timeout=240)


@pytest.mark.parametrize("on", [False, True])
def test_all_gather_in_start_param_sync(on):
    run_distributed(param_sync_modes, 2, on, timeout=180)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_unsharded_memory_independent_of_depth_of_model(depth):
    peaks = [run_distributed(unsharded_memory_bound, 2, n, depth, timeout=180)[0]["peak_unsharded_bytes"]
             for n in (3, 6)]
    assert peaks[0] == peaks[1], f"unsharded peak grows with the number of blocks: {peaks}"
