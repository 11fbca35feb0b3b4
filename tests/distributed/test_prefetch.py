"""Prefetch engine on Gloo: runtime order, bounded unsharded units, explicit targets,
contexts per root, and parity with prefetching and a separate all-gather communicator."""
import pytest

from harness import run_distributed
from harness.workers import (bucketed_gather_counts, param_sync_modes, prefetch_semantics, train_parity,
                             unsharded_memory_bound)


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


@pytest.mark.parametrize("world,opts", [
    (2, {"gather_bucket_bytes": 1}),  # every unit a bucket of its own, gathered through the bucket path
    (2, {"gather_bucket_bytes": 1 << 30, "param_dtype": "bf16"}),  # one bucket: one coalesced, cast in place
    (4, {"gather_bucket_bytes": 1 << 30, "micro_batches": 2}),
])
def test_bucketed_gathers_train_like_one_process(world, opts):
    import torch
    opts = dict(opts, steps=4)
    if opts.get("param_dtype") == "bf16":
        opts.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run_distributed(train_parity, world, opts, timeout=240)


def test_bucketed_gathers_issue_one_collective_per_bucket():
    plain = run_distributed(bucketed_gather_counts, 2, 0, timeout=180)[0]
    one = run_distributed(bucketed_gather_counts, 2, 1 << 30, timeout=180)[0]
    units = plain["units"]
    # Every unit gathered in forward, every block again in backward: the same either way.
    assert plain["fwd_unshards"] == one["fwd_unshards"] == units
    assert plain["bwd_unshards"] == one["bwd_unshards"] == units - 1
    # One collective per unit and use, against one for the whole forward and one for backward.
    assert plain["all_gathers"] == 2 * units - 1, plain
    assert one["all_gathers"] == 2, one
    # set_gather_bucket_bytes on the root between steps: the same plan from the next step.
    later = run_distributed(bucketed_gather_counts, 2, 1 << 30, True, timeout=180)[0]
    assert later == one, later
