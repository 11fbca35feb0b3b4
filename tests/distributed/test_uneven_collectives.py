"""C++ all_gather_v / reduce_scatter_v on Gloo against a torch reference."""
import pytest

from harness import run_distributed
from harness.workers import uneven_collectives


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_collectives_gloo(world):
    checked = run_distributed(uneven_collectives, world, ["AUTO", "PADDED", "ALL_REDUCE"], timeout=180)
    assert all(c == 18 for c in checked)



def _grouped_on_cpu(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_fsdp_ext import _C
    from harness.workers import expect_error

    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    out = torch.zeros(3)
    expect_error(lambda: comm.all_gather_v(out, torch.zeros(1 + rank), [0, 1], [1, 2], _C.VarAlgo.GROUPED),
                 RuntimeError, "GROUPED", "CUDA")
    expect_error(lambda: comm.all_gather_v(out, torch.zeros(5), [0, 1], [1, 2]), RuntimeError,
                 f"rank {rank} passes 5 elements")
    expect_error(lambda: comm.reduce_scatter_v(torch.zeros(1), out, [0, 2], [2, 2]), RuntimeError,
                 "segment 1 [2, 4) is outside the flat buffer of 3")


def test_uneven_collectives_bad_input():
    run_distributed(_grouped_on_cpu, 2, timeout=120)
