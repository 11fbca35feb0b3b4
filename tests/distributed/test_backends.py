"""Any c10d backend: decisions by capability, the fallbacks for what a backend lacks
(checked against the process group's own calls and a single-process reference), torch's
fake backend (one process plays rank r of W: units, counters, skipped checks, refused
checkpoints), a backend that refuses collectives, mixed per-device backends."""
import pytest

from harness import run_distributed
from harness import backend_workers as BW
from harness.workers import bucketed_collective_counts, check_parity_results, train_parity

ONE_BUCKET = 1 << 30
NO_COALESCING = {("gloo", "cpu"): {"coalesced_all_gather": False, "coalesced_reduce_scatter": False}}
NO_FLAT = {("gloo", "cpu"): {"flat_all_gather": False, "flat_reduce_scatter": False}}


def _expected_step(result, per_unit_gathers=True):
    """Our counters for one steady ZeRO-3 step: every unit gathered in forward, every
    block again in backward (the root stays unsharded), one reduce-scatter per unit, each
    after the all-reduce of which parameters got gradients."""
    g, r, f = result["gather_bytes"], result["reduce_bytes"], result["flag_bytes"]
    return {"all_gather": (2 * len(g) - 1, sum(g) + sum(g[1:])), "reduce_scatter": (len(r), sum(r)),
            "all_reduce": (len(f), sum(f) + 8 * len(f))}


@pytest.mark.parametrize("rank", [0, 5])
def test_fake_backend_trains_on_one_process_and_counts_every_collective(rank):
    out = run_distributed(BW.simulated_training, 8, {}, backend="fake", simulate_rank=rank, timeout=180)[0]
    assert out["steady_step"] == _expected_step(out), out
    # Said once, not per unit or step.
    assert len(out["warnings"]) == 1 and "cross-rank agreement" in out["warnings"][0], out["warnings"]


def test_fake_backend_skips_the_collective_check_instead_of_comparing_itself():
    # MFSDP_CHECK_COLLECTIVES=1 exchanges (unit, phase, size) before each collective: under
    # fake that would compare this rank with itself, so it is skipped: no extra all-gathers.
    plain = run_distributed(BW.simulated_training, 8, {}, backend="fake", simulate_rank=3, timeout=180)[0]
    checked = run_distributed(BW.simulated_training, 8, {"check_collectives": True}, backend="fake",
                              simulate_rank=3, timeout=180)[0]
    assert checked["steady_step"] == plain["steady_step"], (checked, plain)


def test_fake_backend_buckets_hsdp_and_mixed_precision():
    both = {"gather_bucket_bytes": ONE_BUCKET, "reduce_bucket_bytes": ONE_BUCKET, "bf16": True}
    out = run_distributed(BW.simulated_training, 8, both, backend="fake", simulate_rank=2, timeout=180)[0]
    g, r = out["gather_bytes"], out["reduce_bytes"]
    # One coalesced gather per pass, one coalesced reduce-scatter: bf16 gathers, fp32 reduction;
    # the bucket's gradient agreement is one all-reduce of every member's flags.
    assert out["steady_step"] == {"all_gather": (2, sum(g) + sum(g[1:])), "reduce_scatter": (1, sum(r)),
                                  "all_reduce": (1, sum(out["flag_bytes"]) + 8)}, out
    assert g[0] * 2 == r[0], (g, r)
    hsdp = run_distributed(BW.simulated_training, 8, {"hsdp": (2, 4)}, backend="fake", simulate_rank=6,
                           timeout=180)[0]
    expected = _expected_step(hsdp)
    # The shards across replicas; the gradient flags over the shard group, then the replicas.
    flags = sum(hsdp["flag_bytes"]) + 8 * hsdp["units"]
    expected["all_reduce"] = (3 * hsdp["units"], sum(hsdp["shard_bytes"]) + 2 * flags)
    assert hsdp["steady_step"] == expected, hsdp


def test_fake_backend_refuses_checkpoints_by_name(tmp_path):
    run_distributed(BW.simulated_checkpoints_refused, 4, str(tmp_path / "ckpt"), backend="fake", simulate_rank=1,
                    timeout=180)


def test_a_backend_that_refuses_a_collective_is_named():
    run_distributed(BW.refusing_backend_is_named, 4, backend="fake", simulate_rank=1, timeout=120)


def test_without_coalesced_collectives_buckets_issue_one_collective_per_unit():
    both = {"gather_bucket_bytes": ONE_BUCKET, "reduce_bucket_bytes": ONE_BUCKET}
    coalesced = run_distributed(bucketed_collective_counts, 2, both, timeout=180)[0]
    fallback = run_distributed(BW.under_capabilities, 2, NO_COALESCING, bucketed_collective_counts, both,
                               timeout=180)[0]
    units = fallback["units"]
    assert coalesced["c10d_calls"] == {"c10d::allgather_into_tensor_coalesced_": 2,
                                       "c10d::reduce_scatter_tensor_coalesced_": 1, "c10d::allreduce_": 1}, coalesced
    # The same buckets (one scope each), each member gathered and reduced by its own call;
    # the bucket's gradient agreement stays one all-reduce.
    assert (fallback["all_gathers"], fallback["reduce_scatters"]) == (2, 1), fallback
    assert fallback["c10d_calls"] == {"c10d::_allgather_base_": 2 * units - 1,
                                      "c10d::_reduce_scatter_base_": units, "c10d::allreduce_": 1}, fallback
    assert fallback["params_with_grad"] == coalesced["params_with_grad"]


def test_without_flat_collectives_units_gather_into_views_and_reduce_by_all_reduce():
    plain = run_distributed(BW.under_capabilities, 2, NO_FLAT, bucketed_collective_counts, {}, timeout=180)[0]
    units = plain["units"]
    # The reduction by all-reduce, after the all-reduce of the gradient flags: two per unit.
    assert plain["c10d_calls"] == {"c10d::allgather_": 2 * units - 1, "c10d::allreduce_": 2 * units}, plain


@pytest.mark.parametrize("caps", [NO_COALESCING, NO_FLAT], ids=["no_coalescing", "no_flat"])
@pytest.mark.parametrize("world", [2, 3])
def test_fallbacks_train_like_one_process(caps, world):
    opts = {"gather_bucket_bytes": ONE_BUCKET, "reduce_bucket_bytes": ONE_BUCKET, "steps": 3, "micro_batches": 2,
            "sync_every_micro": True}
    results = run_distributed(BW.under_capabilities, world, caps, train_parity, opts, timeout=240)
    check_parity_results(results, steps=3)


def test_mixed_backends_decide_per_device_type():
    names = run_distributed(BW.mixed_backend_devices, 2, backend="cpu:gloo,cuda:fake", timeout=120)
    assert names == [{"cpu": "gloo", "cuda": "fake"}] * 2
    results = run_distributed(train_parity, 2, {"steps": 2}, backend="cpu:gloo,cuda:fake", timeout=180)
    check_parity_results(results, steps=2)


def test_dtensor_gather_without_functional_collectives_equals_full_tensor():
    assert run_distributed(BW.dtensor_gather_matches_full_tensor, 4, timeout=120) == [7] * 4


@pytest.mark.parametrize("backend", ["gloo", "fake"])
def test_meta_shards_go_where_the_backend_communicates(backend):
    import torch

    expect = "cuda" if torch.cuda.is_available() else "cpu"
    assert run_distributed(BW.meta_shards_follow_the_backend, 2, expect, backend=backend, timeout=120) == [expect] * (
        1 if backend == "fake" else 2)


def test_test_ranks_run_every_gloo_group_on_one_worker_thread():
    # torch's two worker threads per Gloo group race on the group's status string when two
    # collectives finish together (a double free: harness/gloo_threads.py); the launcher
    # gives every group its ranks create one thread, subgroups and DeviceMesh's included.
    out = run_distributed(BW.gloo_worker_threads, 4, timeout=120)
    for rank_out in out:
        assert rank_out == {name: (1, True) for name in ("world", "new_group", "mesh_rep", "mesh_shard")}, rank_out
