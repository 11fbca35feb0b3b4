"""Gather and reduce buckets on Gloo: consecutive units share one coalesced all-gather
(gather_bucket_bytes) and one coalesced reduce-scatter (reduce_bucket_bytes). Parity with
one process (or FSDP2 under bf16) for the layouts and strategies that join a bucket and
for those that must not (full gradients, HSDP: tests/distributed/test_hsdp.py), and the
number of collectives per step."""
import math

import pytest
import torch

from harness import run_distributed
from megatron_fsdp_ext import link
from harness.workers import accumulated_reductions_in_buckets, bucketed_collective_counts, train_parity

# The test model's units in forward order: root 32,896 B, then three blocks of 50,432 B
# (fp32 gradients); this budget makes two reduce buckets, [root, block 0] and [blocks 1, 2].
TWO_BUCKETS = 101_000
ONE_BUCKET = 1 << 30


@pytest.mark.parametrize("world,opts", [
    (2, {"gather_bucket_bytes": 1}),  # every unit a bucket of its own, gathered through the bucket path
    (2, {"gather_bucket_bytes": ONE_BUCKET, "param_dtype": "bf16"}),  # one bucket: one coalesced, cast in place
    (4, {"gather_bucket_bytes": ONE_BUCKET, "micro_batches": 2}),
])
def test_bucketed_gathers_train_like_one_process(world, opts):
    run_distributed(train_parity, world, _with_dtypes(opts, steps=4), timeout=240)


@pytest.mark.parametrize("world,opts", [
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "clip": 0.05}),
    (2, {"reduce_bucket_bytes": TWO_BUCKETS, "extra_runs": [{"strategy": "optim_grads"}]}),
    # bf16 gradients reduced in fp32, against FSDP2 under the same policy.
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "gather_bucket_bytes": ONE_BUCKET, "param_dtype": "bf16"}),
    # Gradients accumulated without sync, then reduced in one bucket.
    (4, {"reduce_bucket_bytes": TWO_BUCKETS, "micro_batches": 2}),
    # A reduction every micro-batch: the second lands on the first's .grad (accumulate).
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "micro_batches": 2, "sync_every_micro": True}),
    # A parameter that never gets a gradient (unused) and frozen ones: their .grad stays None.
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "unused": True, "frozen": True}),
    # Tied embeddings (one parameter in two slots), and a block run twice in one forward.
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "tie": True, "extra_runs": [{"tie": False, "reuse_block": True}]}),
    # Full gradients (all-reduced) never join a bucket: the same results as without one.
    (2, {"reduce_bucket_bytes": ONE_BUCKET, "strategy": "optim"}),
])
def test_bucketed_reductions_train_like_one_process(world, opts):
    run_distributed(train_parity, world, _with_dtypes(opts, steps=4), timeout=240)


PER_UNIT = {"gather_bucket_bytes": 0, "reduce_bucket_bytes": 0}
AUTO = {"gather_bucket_bytes": "auto", "reduce_bucket_bytes": "auto"}  # fully_shard's default


def test_buckets_issue_one_collective_per_bucket():
    plain = run_distributed(bucketed_collective_counts, 2, PER_UNIT, timeout=180)[0]
    units, params = plain["units"], plain["params"]
    # Every unit gathered in forward, every block again in backward; one collective per
    # unit and use, and one reduce-scatter per unit.
    assert plain["fwd_unshards"] == units and plain["bwd_unshards"] == units - 1, plain
    assert plain["all_gathers"] == 2 * units - 1 and plain["reduce_scatters"] == units, plain
    gathers = run_distributed(bucketed_collective_counts, 2, {"gather_bucket_bytes": ONE_BUCKET}, timeout=180)[0]
    assert gathers["all_gathers"] == 2 and gathers["reduce_scatters"] == units, gathers
    assert gathers["fwd_unshards"] == units and gathers["bwd_unshards"] == units - 1, gathers
    reductions = run_distributed(bucketed_collective_counts, 2, {"reduce_bucket_bytes": TWO_BUCKETS}, timeout=180)[0]
    assert reductions["reduce_scatters"] == 2 and reductions["all_gathers"] == 2 * units - 1, reductions
    both = {"gather_bucket_bytes": ONE_BUCKET, "reduce_bucket_bytes": ONE_BUCKET}
    one = run_distributed(bucketed_collective_counts, 2, both, timeout=180)[0]
    assert one["all_gathers"] == 2 and one["reduce_scatters"] == 1, one
    # What the process group itself was asked: one c10d call per collective above.
    # Before each reduction (a unit's or a bucket's) one all-reduce of which parameters got gradients.
    assert plain["c10d_calls"] == {"c10d::_allgather_base_": 2 * units - 1, "c10d::_reduce_scatter_base_": units,
                                   "c10d::allreduce_": units}, plain
    assert one["c10d_calls"] == {"c10d::allgather_into_tensor_coalesced_": 2,
                                 "c10d::reduce_scatter_tensor_coalesced_": 1, "c10d::allreduce_": 1}, one
    # Every parameter still gets its gradient, every step.
    for counts in (plain, gathers, reductions, one):
        assert counts["params_with_grad"] == [params, params], counts
    # The setters on the root between steps: the same plan from the next step.
    later = run_distributed(bucketed_collective_counts, 2, both, True, timeout=180)[0]
    assert later == one, later


def _with_dtypes(opts, **more):
    opts = dict(opts, **more)
    if opts.get("param_dtype") == "bf16":
        opts.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return opts


def test_auto_buckets_come_from_the_measured_link_and_agree_on_every_rank():
    """The default ("auto"): at the end of the first backward the link is timed and every
    rank plans with the same budget (the slowest rank's times); the budget is the one
    link.auto_bucket_bytes derives, and the plan is the one an explicit budget gives."""
    ranks = run_distributed(bucketed_collective_counts, 2, AUTO, timeout=180)
    assert ranks[0]["budgets"] == ranks[1]["budgets"] and ranks[0]["link"] == ranks[1]["link"], ranks
    gather, reduce = ranks[0]["budgets"]
    # Gloo over loopback: a fixed cost well above zero, a finite bandwidth.
    assert ranks[0]["link"].alpha_s > 0 and math.isfinite(ranks[0]["link"].bytes_per_s), ranks[0]["link"]
    assert gather == reduce == link.auto_bucket_bytes(ranks[0]["link"]) > 0, ranks[0]
    # A link whose fixed cost is worth 900 KB (1e-4 s at 1e9 B/s, times 9): a 1 MiB
    # budget, more than the whole test model, so one bucket each way.
    fast = run_distributed(bucketed_collective_counts, 2, AUTO, False, (1e-4, 1e9), timeout=180)[0]
    assert fast["budgets"] == (1 << 20, 1 << 20) and fast["unit_bytes"] < 1 << 20, fast
    assert fast["all_gathers"] == 2 and fast["reduce_scatters"] == 1, fast
    explicit = run_distributed(bucketed_collective_counts, 2, {"gather_bucket_bytes": 1 << 20,
                                                               "reduce_bucket_bytes": 1 << 20}, timeout=180)[0]
    assert {k: v for k, v in fast.items() if k != "link"} == {k: v for k, v in explicit.items() if k != "link"}
    # A link with no latency worth saving (1 us at 1 MB/s: 9 bytes): 16 B, below any unit
    # (the root's 32,896 B), so every bucket is one unit, as with that budget set.
    slow = run_distributed(bucketed_collective_counts, 2, AUTO, False, (1e-6, 1e6), timeout=180)[0]
    assert slow["budgets"] == (16, 16), slow
    tiny = run_distributed(bucketed_collective_counts, 2, {"gather_bucket_bytes": 16, "reduce_bucket_bytes": 16},
                           timeout=180)[0]
    assert {k: v for k, v in slow.items() if k != "link"} == {k: v for k, v in tiny.items() if k != "link"}


def test_auto_buckets_are_off_where_nothing_moves():
    """World 1 and torch's fake backend (nothing moves: no bandwidth to measure) plan no
    buckets, and train."""
    one = run_distributed(bucketed_collective_counts, 1, AUTO, timeout=180)[0]
    assert one["budgets"] == (0, 0), one
    fake = run_distributed(bucketed_collective_counts, 8, AUTO, backend="fake", simulate_rank=3, timeout=180)[0]
    assert fake["budgets"] == (0, 0) and math.isinf(fake["link"].bytes_per_s), fake


def test_a_given_link_plans_auto_buckets_without_timing_even_where_nothing_moves():
    """set_link_model: "auto" plans from the link the root was given, without the probe
    (the worker fails if it runs), also under torch's fake backend, where a sizing run
    then buckets as the real machine would; the plan is the one that budget set
    explicitly gives."""
    given = (1e-4, 1e9)  # 1 MiB budget: one bucket each way for the test model
    fake = run_distributed(bucketed_collective_counts, 8, AUTO, False, None, given, backend="fake",
                           simulate_rank=3, timeout=180)[0]
    assert fake["budgets"] == (1 << 20, 1 << 20) and fake["link"] == link.LinkModel(*given), fake
    assert fake["all_gathers"] == 2 and fake["reduce_scatters"] == 1, fake
    gloo = run_distributed(bucketed_collective_counts, 2, AUTO, False, None, given, timeout=180)[0]
    explicit = run_distributed(bucketed_collective_counts, 2, {"gather_bucket_bytes": 1 << 20,
                                                               "reduce_bucket_bytes": 1 << 20}, timeout=180)[0]
    assert {k: v for k, v in gloo.items() if k != "link"} == {k: v for k, v in explicit.items() if k != "link"}


def test_link_models_and_the_setter_refuse_bad_values():
    for bad, error in (((-1e-6, 1e9), ValueError), ((1e-6, 0.0), ValueError), ((math.inf, 1e9), ValueError),
                       ((math.nan, 1e9), TypeError), (("1e-6", 1e9), TypeError)):
        with pytest.raises(error, match="LinkModel"):
            link.LinkModel(*bad)
    from megatron_fsdp_ext.core.options import UnitOptions
    with pytest.raises(TypeError, match="link_model must be a megatron_fsdp_ext.link.LinkModel"):
        UnitOptions(link_model=(1e-6, 1e9))


def test_accumulated_gradients_reduced_by_finish_grad_sync_use_the_reduce_buckets():
    """Gradients accumulated without sync and reduced by finish_grad_sync() (torch's
    pipelining reduces the same way in its REDUCE_GRAD) go through the reduce bucket, as
    a synced last backward's do: one coalesced reduce-scatter for the four units, not one
    each (before: four, silently), and the same gradients bit for bit."""
    out = run_distributed(accumulated_reductions_in_buckets, 2, timeout=180)
    for r in out:
        assert r["synced_last_backward"]["reduce_scatters"] == [1, 1], r["synced_last_backward"]["reduce_scatters"]
        assert r["finish_grad_sync"]["reduce_scatters"] == [1, 1], r["finish_grad_sync"]["reduce_scatters"]
        assert r["same_grads"], "finish_grad_sync's gradients differ from the synced last backward's"


def test_reduce_buckets_after_finish_grad_sync_train_like_one_process():
    """Two reduce buckets, two micro-batches accumulated, finish_grad_sync(): one process's
    training."""
    run_distributed(train_parity, 4, _with_dtypes({"reduce_bucket_bytes": TWO_BUCKETS, "micro_batches": 2,
                                                        "finish_grad_sync": True}, steps=3), timeout=240)
