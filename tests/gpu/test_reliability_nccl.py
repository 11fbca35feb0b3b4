"""The cross-rank checks on NCCL (CUDA tensors, one GPU per rank): different models are
refused at the first forward, out-of-step ranks get a named error under
MFSDP_CHECK_COLLECTIVES=1, an uneven collective with rank-dependent segment tables is
refused, and fully_shard(timeout=...) builds working NCCL groups."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from harness import gpu_launch, gpu_world, run_distributed
from harness.workers import expect_error

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)


class _Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, width), nn.Linear(width, 16)])
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _shard(net, **kwargs):
    for b in net.blocks:
        mfsdp.fully_shard(b, **kwargs)
    return mfsdp.fully_shard(net, **kwargs)


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _different_models(rank, world):
    net = _shard(_Net(width=16 if rank == 0 else 48).to(_device()))
    expect_error(lambda: net(torch.randn(2, 16, device=_device())), ValueError, "ranks built different models",
                 "unit 'blocks.1'")


def test_nccl_different_models_are_refused():
    run_distributed(_different_models, WORLD, **GPU, timeout=180)


def _out_of_step(rank, world):
    os.environ["MFSDP_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    net = _shard(_Net().to(_device()), timeout=60)
    x = torch.randn(4, 16, device=_device())
    net(x).sum().backward()  # in step: the check passes on every collective
    torch.cuda.synchronize()

    def out_of_step_step():
        if rank == 1:  # units run outside the root's forward: no root, no backward
            with torch.no_grad():
                net.blocks[2](torch.relu(net.blocks[1](torch.relu(net.blocks[0](x)))))
        net(x).sum().backward()

    # The check is symmetric (every rank compares every rank's entry), so both ranks fail
    # at the same exchange: on rank 1 possibly already in the extra block calls.
    expect_error(out_of_step_step, RuntimeError, "collectives out of step")
    # Every collective issued before the refused one was matched: the group still works.
    flag = torch.ones(1, device=_device())
    dist.all_reduce(flag)
    assert flag.item() == world, flag


def test_nccl_out_of_step_ranks_get_a_named_error():
    run_distributed(_out_of_step, WORLD, **GPU, timeout=240)


def _uneven_tables(rank, world):
    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    numels = [3 + rank] + [4] * (world - 1)
    starts = [sum(numels[:r]) for r in range(world)]
    out = torch.zeros(sum(numels), device=_device())
    expect_error(lambda: comm.all_gather_v(out, torch.ones(numels[rank], device=_device()), starts, numels),
                 RuntimeError, "passed different segment starts/numels")


def test_nccl_all_gather_v_refuses_rank_dependent_tables():
    run_distributed(_uneven_tables, WORLD, **GPU, timeout=180)


@pytest.mark.dtensor_collectives
def test_state_dict_on_one_rank_fails_naming_the_others_gpu():
    """The ranks meet through the store before a state-dict collective on NCCL too: a call
    on rank 0 alone fails there naming the others, and issues no NCCL collective."""
    from harness.adversarial_workers import check_one_rank_state_dicts, one_rank_state_dicts

    timeout = 4
    check_one_rank_state_dicts(run_distributed(one_rank_state_dicts, WORLD, {"timeout": timeout}, **GPU,
                                               timeout=180), timeout)


class _LayerDrop(_Net):
    """Ranks alternate between the last two blocks (the same size): every collective pairs."""

    def forward(self, x):
        skipped = 1 + dist.get_rank() % 2
        for i, b in enumerate(self.blocks):
            if i != skipped:
                x = torch.relu(b(x))
        return self.head(x)


def _units_skipped_on_some_ranks(rank, world):
    torch.manual_seed(0)
    net = _shard(_LayerDrop().to(_device()), timeout=60)
    x = torch.randn(4, 16, device=_device())
    # On the GPU the word is read without waiting, at the unit's next agreement: the
    # second backward at the latest (the first where this rank lacked a gradient).
    expect_error(lambda: [net(x).sum().backward() for _ in range(3)], RuntimeError,
                 "ranks reduced different fully_shard units together")


def test_units_skipped_on_some_ranks_fail_instead_of_pairing_across_units_gpu():
    """Rank-dependent control flow that skips a whole unit of the same size on each rank
    pairs NCCL collectives across units without a size mismatch; the gradient-flag
    all-reduce carries which units each rank reduced and the mismatch is named."""
    if WORLD < 2:
        pytest.skip("needs two ranks")
    run_distributed(_units_skipped_on_some_ranks, WORLD, **GPU, timeout=180)
