"""HSDP: fully_shard on a 2-D (replicate, shard) DeviceMesh on Gloo world 4, against a plain
single-process model (gradients every step, clipped norms, parameters), for the 2x2, 4x1
and 1x4 meshes and every strategy; the all-reduce across replicas deferred under gradient
accumulation (counted from the profiler scopes); checkpoints between HSDP and FSDP."""
import pytest

from harness import run_distributed
from harness.hsdp_workers import estimate_matches_what_units_hold, hsdp_checkpoints, hsdp_errors, hsdp_parity

EVERY_STRATEGY = ["optim_grads_params", "optim_grads", "optim", "no_shard"]

MESHES = {
    # (replicate, scenarios)
    "2x2": (2, [{"strategy": s, "micro": 2, "defer": True, "clip": 0.05} for s in EVERY_STRATEGY]
            + [{"strategy": "optim_grads_params", "micro": 2}, {"strategy": "optim_grads", "config": True},
               {"strategy": "optim_grads_params", "micro": 2, "defer": True, "timeout": 120},
               {"strategy": "optim", "create_all_gather_group": True},
               # Buckets: gathers coalesced; reductions stay per unit (their all-reduce follows).
               {"strategy": "optim_grads_params", "micro": 2, "defer": True, "gather_bucket_bytes": 1 << 30,
                "reduce_bucket_bytes": 1 << 30}]),
    "4x1": (4, [{"strategy": "optim_grads_params", "micro": 2, "defer": True, "clip": 0.05},
                {"strategy": "no_shard"}]),
    "1x4": (1, [{"strategy": "optim_grads_params", "clip": 0.05}, {"strategy": "optim", "micro": 2, "defer": True},
                # One replica: nothing follows the reduce-scatter, so the bucket shares one.
                {"strategy": "optim_grads_params", "micro": 2, "reduce_bucket_bytes": 1 << 30}]),
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_hsdp_trains_like_one_process(mesh):
    replicate, scenarios = MESHES[mesh]
    results = run_distributed(hsdp_parity, 4, replicate, scenarios, timeout=300)
    assert len(results[0]) == len(scenarios)


def test_hsdp_checkpoints_move_between_meshes(tmp_path):
    run_distributed(hsdp_checkpoints, 4, str(tmp_path), timeout=300)


def test_hsdp_misuse_is_refused():
    run_distributed(hsdp_errors, 4, timeout=120)


@pytest.mark.parametrize("strategy,bf16,frozen", [("optim_grads_params", False, False),
                                                  ("optim_grads_params", True, False), ("optim_grads", True, False),
                                                  ("optim", False, False), ("no_shard", True, False),
                                                  ("optim_grads_params", False, True), ("optim", False, True)])
def test_estimate_memory_equals_what_the_units_hold(strategy, bf16, frozen):
    run_distributed(estimate_matches_what_units_hold, 4, strategy, bf16, frozen, timeout=180)
