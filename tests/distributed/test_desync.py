"""Ranks that disagree fail loudly and in bounded time: different models are refused at
the first forward, and a stalled or desynchronized rank makes the others fail within
fully_shard(timeout=...) with an error naming the unit and the phase."""
import copy
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from harness import run_distributed
from harness.adversarial_workers import check_one_rank_state_dicts, one_rank_state_dicts
from harness.workers import expect_error

TIMEOUT_S = 4
STALL_S = 2 * TIMEOUT_S + 1  # how long the stalled rank sleeps


class _Net(nn.Module):
    def __init__(self, widths=(8, 8), hidden=8):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(hidden, w), nn.ReLU(), nn.Linear(w, hidden))
                                     for w in widths])
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _shard(net, **kwargs):
    for b in net.blocks:
        mfsdp.fully_shard(b, **kwargs)
    return mfsdp.fully_shard(net, **kwargs)


def _first_forward_error(net) -> str:
    try:
        net(torch.randn(2, 8)).sum().backward()
    except ValueError as e:
        return str(e)
    raise AssertionError("ranks with different models trained without an error")


def _different_models(rank, world, case):
    torch.manual_seed(0)
    if case == "shape":  # same flat size after padding, different shapes
        net = _Net() if rank == 0 else _Net()
        if rank == 1:
            net.blocks[1][0] = nn.Linear(8, 8, bias=False)
            net.blocks[1][0].register_parameter("extra", nn.Parameter(torch.zeros(8)))
        _shard(net)
    elif case == "order":  # the same parameters registered in another order
        net = _Net()
        if rank == 1:
            lin = net.blocks[0][0]
            w, b = lin._parameters.pop("weight"), lin._parameters.pop("bias")
            lin._parameters["bias"], lin._parameters["weight"] = b, w
        _shard(net)
    elif case == "size":  # different sizes: without the check, an abort inside Gloo
        net = _Net(widths=(8, 8) if rank == 0 else (8, 24))
        _shard(net)
    elif case == "strategy":
        net = _Net()
        _shard(net, sharding_strategy="optim_grads_params" if rank == 0 else "optim_grads")
    elif case == "dtype":
        net = _Net()
        _shard(net, mp_policy=mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if rank == 1 else None))
    else:
        raise ValueError(case)
    return _first_forward_error(net)


@pytest.mark.parametrize("case,first,fragment", [
    ("shape", "blocks.1", "0.extra"),
    ("order", "blocks.0", "0.bias"),
    ("size", "blocks.1", "(24, 8)"),
    ("strategy", "_Net (root)", "strategy=optim_grads param_dtype"),
    ("dtype", "_Net (root)", "param_dtype=torch.bfloat16"),
])
def test_different_models_are_refused(case, first, fragment):
    messages = run_distributed(_different_models, 2, case, timeout=90)
    for m in messages:
        assert "ranks built different models" in m, m
        assert f"unit '{first}'" in m, m
    assert any(fragment in m for m in messages), messages


def _trained_step(net, opt, x):
    opt.zero_grad()
    net(x).sum().backward()
    opt.step()


def _desync(rank, world, case):
    # "<case>+buckets": every unit in one gather and one reduce bucket (coalesced collectives).
    case, _, variant = case.partition("+")
    # Without: one collective per unit (the "auto" default would bucket this small model too).
    buckets = {"gather_bucket_bytes": 1 << 30, "reduce_bucket_bytes": 1 << 30} if variant == "buckets" \
        else {"gather_bucket_bytes": 0, "reduce_bucket_bytes": 0}
    if case != "stall":
        # Units out of step: without the check, Gloo aborts the process on the size
        # mismatch ("collective mismatch") and NCCL hangs until its watchdog fires.
        os.environ["MFSDP_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    net = _shard(_Net(), timeout=TIMEOUT_S, **buckets)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    _trained_step(net, opt, x)  # in step once (and the order recorded): the failure below is mid-training
    start = time.monotonic()
    try:
        if case == "stall":
            if rank == 1:
                # Past the latest time the test accepts rank 0's error (2 * TIMEOUT_S): a
                # timeout that fires later, or never, fails the test either way.
                time.sleep(STALL_S)
            _trained_step(net, opt, x)
        elif case == "skipped_backward":
            if rank == 1:
                with torch.no_grad():
                    net(x)
            else:
                _trained_step(net, opt, x)
            _trained_step(net, opt, x)
        elif case == "units_outside_root":
            if rank == 1:  # blocks run directly: no root forward, no backward
                with torch.no_grad():
                    net.blocks[1](net.blocks[0](x))
            _trained_step(net, opt, x)
        elif case == "extra_unit":
            if rank == 0:
                net.blocks[1](x)  # an extra unit forward (with grad) that rank 1 does not run
            _trained_step(net, opt, x)
            _trained_step(net, opt, x)
        else:
            raise ValueError(case)
    except RuntimeError as e:
        elapsed, message = time.monotonic() - start, str(e)
        if case != "stall":
            # The check is symmetric, so every collective issued before the refused one
            # was matched: the process group still works.
            flag = torch.ones(1)
            dist.all_reduce(flag)
            assert flag.item() == world, flag
        return elapsed, message
    return time.monotonic() - start, None


@pytest.mark.parametrize("case", ["stall", "skipped_backward", "units_outside_root", "extra_unit",
                                  "stall+buckets", "skipped_backward+buckets"])
def test_desynchronized_rank_fails_in_bounded_time(case):
    start = time.monotonic()
    results = run_distributed(_desync, 2, case, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"{case}: took {elapsed:.0f}s"
    errors = [(t, m) for t, m in results if m is not None]
    assert errors, f"{case}: no rank saw an error: {results}"
    for t, m in errors:
        if case.startswith("stall"):
            # Bucketed, the coalesced collective names all its units.
            unit = "units '_Net (root)', 'blocks.0', 'blocks.1'" if case.endswith("buckets") else "unit '"
            assert f"all-gather of parameters of fully_shard {unit}" in m and "failed on rank" in m, m
        else:
            assert "collectives out of step" in m and "of fully_shard unit '" in m, m
        assert t < 5 * TIMEOUT_S, f"{case}: the error came after {t:.1f}s with timeout {TIMEOUT_S}s"
    if case.startswith("stall"):  # the waiting rank is the one that must fail, within the timeout
        t, m = results[0]
        assert m is not None and "all-gather of parameters" in m, results
        assert TIMEOUT_S - 1 <= t < 2 * TIMEOUT_S, f"rank 0 failed after {t:.1f}s"


class _LayerDrop(nn.Module):
    """Each rank runs a different one of two blocks of the same size: their collectives
    pair across units without any size mismatch."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = torch.tanh(self.blocks[0](x))
        return self.head(x + self.blocks[1 + dist.get_rank() % 2](x))


def _units_skipped_on_some_ranks(rank, world, buckets):
    torch.manual_seed(0)
    net = _LayerDrop()
    for b in net.blocks:
        mfsdp.fully_shard(b, timeout=TIMEOUT_S)
    mfsdp.fully_shard(net, timeout=TIMEOUT_S, gather_bucket_bytes=0, reduce_bucket_bytes=buckets)
    try:
        net(torch.randn(4, 8)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("buckets", [0, 1 << 30], ids=["units", "bucket"])
def test_units_skipped_on_some_ranks_fail_instead_of_pairing_across_units(buckets):
    """Without the opt-in collective check: the agreement on which parameters got
    gradients carries which units each rank reduces, so ranks that ran different units
    of one size fail in the backward that paired them, naming their unit, on every rank
    (on the GPU one reduction later: the word is read without waiting)."""
    errors = run_distributed(_units_skipped_on_some_ranks, 2, buckets, timeout=90)
    for rank, message in enumerate(errors):
        assert message is not None and "ranks reduced different fully_shard units together" in message, errors
        assert f"where rank {rank} reduced the gradients of unit" in message and "LayerDrop" in message, message


def _bad_timeouts(rank, world):
    for bad in (0, -1, "5", True, datetime.timedelta(seconds=-2)):
        expect_error(lambda: mfsdp.fully_shard(nn.Linear(2, 2), timeout=bad), ValueError,
                     "timeout must be a positive")
    group = dist.new_group([0])
    expect_error(lambda: mfsdp.fully_shard(nn.Linear(2, 2), timeout=3, reduce_scatter_group=group), ValueError,
                 "either timeout= or explicit")


def test_timeout_argument_checked():
    run_distributed(_bad_timeouts, 1, timeout=60)
    # FSDPConfig applies fully_shard's rule and names its own field.
    for bad in (0, -1.5, float("inf"), True, "60", datetime.timedelta(0)):
        with pytest.raises(ValueError, match=r"FSDPConfig.collective_timeout: timeout must be a positive"):
            mfsdp.FSDPConfig(collective_timeout=bad)
    for good in (30, 0.5, datetime.timedelta(minutes=2), None):
        assert mfsdp.FSDPConfig(collective_timeout=good).collective_timeout == good


def test_state_dict_on_one_rank_fails_naming_the_others():
    check_one_rank_state_dicts(run_distributed(one_rank_state_dicts, 2, {"timeout": TIMEOUT_S}, timeout=120),
                               TIMEOUT_S)


def _submodule_state_dict_on_one_rank(rank, world):
    """state_dict() of a module inside a unit (not the unit's own module), called by rank 0
    alone, as PEFT's save lists a saved module's keys: it once waited in the gather
    silently; it fails within the unit's timeout naming rank 1, issuing no collective,
    and the same call on every rank then gives plain PyTorch's values."""
    os.environ["MFSDP_ARRIVAL_WARN_S"] = "1"
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Linear(4, 2))
    model = copy.deepcopy(plain)
    mfsdp.fully_shard(model[0], timeout=TIMEOUT_S)
    mfsdp.fully_shard(model, timeout=TIMEOUT_S)
    inner = model[0][2]
    if rank == 0:
        expect_error(inner.state_dict, RuntimeError, "did not call it", "[1]", "no collective was issued")
    else:
        time.sleep(TIMEOUT_S + 3)
    flag = torch.ones(1)
    dist.all_reduce(flag)  # no collective of the failed call is pending
    assert flag.item() == world
    values = {k: v.full_tensor() for k, v in inner.state_dict().items()}
    for k, v in plain[0][2].state_dict().items():
        assert torch.equal(values[k], v), k
    return True


def test_state_dict_of_a_module_inside_a_unit_on_one_rank_fails_naming_the_others():
    assert run_distributed(_submodule_state_dict_on_one_rank, 2, timeout=120) == [True, True]
