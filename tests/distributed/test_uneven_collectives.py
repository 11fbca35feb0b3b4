"""C++ all_gather_v / reduce_scatter_v on Gloo against a torch reference (GROUPED, which
needs uneven collective lists, refused by name)."""
import pytest

from harness import run_distributed
from harness.workers import uneven_collectives


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_collectives_gloo(world):
    checked = run_distributed(uneven_collectives, world, ["AUTO", "GROUPED", "PADDED", "ALL_REDUCE"], timeout=180)
    assert all(c == 24 for c in checked)



def _grouped_on_cpu(rank, world):
    import torch
    import torch.distributed as dist

    from megatron_fsdp_ext import _C
    from harness.workers import expect_error

    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    out = torch.zeros(3)
    expect_error(lambda: comm.all_gather_v(out, torch.zeros(1 + rank), [0, 1], [1, 2], _C.VarAlgo.GROUPED),
                 ValueError, "GROUPED uneven algorithm needs a backend with uneven collective lists",
                 "backend 'gloo' on cpu tensors has none")
    expect_error(lambda: comm.all_gather_v(out, torch.zeros(5), [0, 1], [1, 2]), RuntimeError,
                 f"rank {rank} passes 5 elements")
    expect_error(lambda: comm.reduce_scatter_v(torch.zeros(1), out, [0, 2], [2, 2]), RuntimeError,
                 "segment 1 [2, 4) is outside the flat buffer of 3")


def test_uneven_collectives_bad_input():
    run_distributed(_grouped_on_cpu, 2, timeout=120)


def _coalesced(rank, world):
    """The coalesced all-gather and reduce-scatter (one collective for several pairs, an
    empty pair among them) give what one collective per pair gives; bad sizes are named."""
    import torch
    import torch.distributed as dist

    from megatron_fsdp_ext import _C
    from harness.workers import expect_error

    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    sizes = [5, 0, 3]
    gen = torch.Generator().manual_seed(rank)
    ins = [torch.randn(n * world, generator=gen) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    comm.reduce_scatter_flat_coalesced(outs, ins)
    for n, x, out in zip(sizes, ins, outs):
        want = x.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(out, want[rank * n:(rank + 1) * n], rtol=1e-6, atol=1e-6)
    shards = [torch.full((n,), float(rank + 10 * i)) for i, n in enumerate(sizes)]
    full = [torch.empty(n * world) for n in sizes]
    comm.all_gather_flat_coalesced(full, shards)
    for i, (n, f) in enumerate(zip(sizes, full)):
        want = torch.cat([torch.full((n,), float(r + 10 * i)) for r in range(world)])
        assert torch.equal(f, want), (i, f, want)
    expect_error(lambda: comm.reduce_scatter_flat_coalesced([torch.empty(2)], [torch.empty(2 * world + 1)]),
                 RuntimeError, "reduce_scatter_flat_coalesced: input 0 has")
    expect_error(lambda: comm.all_gather_flat_coalesced([torch.empty(2)], []), RuntimeError, "1 outputs but 0 inputs")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_coalesced_collectives_match_one_per_pair(world):
    run_distributed(_coalesced, world, timeout=120)
