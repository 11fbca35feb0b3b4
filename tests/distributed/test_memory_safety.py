"""No crash reachable from Python: freed unsharded memory, unbound units and wrong
collective arguments raise clear errors (the fuzz test drives the whole _C surface)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from harness import run_distributed
from harness.workers import TinyBlock, expect_error
from harness.workers import originals_freed_at_once as w_originals_freed_at_once

FREED = "freed by reshard()"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TinyBlock(), TinyBlock()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _sharded_net():
    torch.manual_seed(0)
    net = _Net()
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    for b in net.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net)
    return net, ref


def _kept_references(rank, world):
    net, ref = _sharded_net()
    block = net.blocks[0]
    # fully_shard holds no unsharded memory until a unit is first gathered.
    for b in net.blocks:
        assert b._fsdp_state.unit.unsharded_storage_bytes == 0, "a unit holds unsharded memory right after fully_shard"
    with torch.no_grad():  # the root's lazy init names every unit by its path
        net(torch.randn(2, 8))

    # 1. unshard(), keep the full weight (and a view of it), reshard(), read it.
    block.unshard()
    kept = block.lin.weight
    kept_view = kept.t()[1:3]
    assert torch.equal(kept.detach(), ref.blocks[0].lin.weight.detach())
    block.reshard()
    assert kept.shape == (8, 8)  # the shape stays: only the memory is gone
    for read in (lambda: kept.sum(), lambda: kept + 1, lambda: kept.tolist(), lambda: repr(kept),
                 lambda: kept_view.clone(), lambda: kept.detach().add_(1), lambda: kept.data_ptr()):
        expect_error(read, RuntimeError, FREED, "blocks.0")
    # Unsharded again: the same tensor holds valid, current values.
    block.unshard()
    assert torch.equal(kept.detach(), ref.blocks[0].lin.weight.detach())
    block.reshard()

    # 2. A weight kept by a forward pre-hook, read after backward (unit resharded).
    seen = []
    handle = net.blocks[1].lin.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    x = torch.randn(4, 8)
    net(x).sum().backward()
    handle.remove()
    assert len(seen) == 1
    expect_error(lambda: seen[0].sum(), RuntimeError, FREED, "blocks.1")
    # Training goes on correctly after the refused reads: gradients match plain PyTorch.
    ref(x).sum().backward()
    full = mfsdp.full_state_dict(net, rank0_only=False)
    assert torch.allclose(full["blocks.1.lin.weight"], ref.blocks[1].lin.weight)
    grads = {n: p.grad for n, p in net.named_parameters()}
    piece = grads["blocks.1.lin.weight"]
    state = net.blocks[1]._fsdp_state
    slice_ = state.unit.layout.shard_slice(0, rank)
    expected = ref.blocks[1].lin.weight.grad.reshape(-1)[slice_.param_offset: slice_.param_offset + slice_.numel]
    assert torch.allclose(piece, expected, atol=1e-6), "gradient differs from plain PyTorch after a refused read"

    # 3. A gradient that is a view of the gathered weight (a hook sets it): the weight is
    # freed before the gradients are packed, so the post-backward refuses it by name.
    def grad_is_the_weight(module, args):
        module.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.detach()[:]))
    net.blocks[0].lin.register_forward_pre_hook(grad_is_the_weight)
    expect_error(lambda: net(x).sum().backward(), RuntimeError, "the gradient of 'lin.weight'", "'blocks.0'",
                 "is a view of the gathered parameters")


@pytest.mark.skipif(not _C.freed_storage_guard(), reason="this torch's StorageImpl cannot refuse reads of freed "
                    "storage (no clear_data_ptr_access_error_msg_); CI's torch 2.13 can")
def test_kept_unsharded_parameter_raises_after_reshard():
    run_distributed(_kept_references, 2, timeout=120)


def _unbound_unit(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    unit = _C.Unit([torch.randn(6, 4)], ["w"], pg, 16, None, None, _C.ShardingStrategy.OPTIM_GRADS_PARAMS)
    for call in (unit.unshard, lambda: unit.reduce_grads(True), unit.gather_full_params,
                 lambda: unit.shard_changed(0, torch.zeros(6, 4))):
        expect_error(call, RuntimeError, "no parameters bound yet", "'w'")
    expect_error(lambda: unit.bind_params([torch.zeros(3)], [torch.zeros(6, 4)]), RuntimeError,
                 "sharded parameter 'w' must be a 1-D")
    # The slots read the parameter objects from their unit: none bound yet, nothing to install.
    slots = _C.ParamSlots(unit)
    slots.add({"w": None}, "w", 0)
    for call in (lambda: slots.install(True), lambda: slots.install(False), lambda: slots.use([], False),
                 lambda: slots.release(False)):
        expect_error(call, RuntimeError, "no parameters bound yet", "'w'")
    expect_error(lambda: slots.add({}, "w", -1), RuntimeError, "negative")
    expect_error(lambda: slots.add({}, "w", 1), RuntimeError, "past the 1 parameters")
    assert unit.sharded_params == [] and unit.unsharded_params == []
    # Slots without a unit (a state without parameters) hold no slot and install nothing.
    empty = _C.ParamSlots(None)
    expect_error(lambda: empty.add({}, "w", 0), RuntimeError, "no unit")
    expect_error(lambda: empty.install(True), RuntimeError, "no unit")
    assert empty.use([], True) == [] and empty.release(False) == [] and not empty.holds_unsharded


def test_unbound_unit_and_slots_raise():
    run_distributed(_unbound_unit, 1, timeout=60)


def _collective_arguments(rank, world):
    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    expanded = torch.ones(1).expand(8)
    strided = torch.zeros(16)[::2]
    for bad in (expanded, strided):
        expect_error(lambda: comm.all_reduce_sum(bad), RuntimeError, "all_reduce: tensor must be contiguous")
        expect_error(lambda: comm.broadcast(bad, 0), RuntimeError, "broadcast: tensor must be contiguous")
        expect_error(lambda: comm.all_gather_flat(torch.zeros(16), bad), RuntimeError, "input must be contiguous")
        expect_error(lambda: comm.reduce_scatter_flat(bad[:4], torch.zeros(8)), RuntimeError,
                     "output must be contiguous")
    expect_error(lambda: comm.broadcast(torch.zeros(4), world), RuntimeError, f"root {world} is not a rank")
    expect_error(lambda: comm.all_gather_flat(torch.zeros(8, dtype=torch.float64), torch.zeros(4)), RuntimeError,
                 "dtype mismatch")
    # Segment tables that differ across ranks: refused on every rank, nothing written.
    numels = [3, 5] if rank == 0 else [4, 4]
    out = torch.full((8,), -1.0)
    mine = torch.full((numels[rank],), float(rank))
    starts = [0, numels[0]]
    expect_error(lambda: comm.all_gather_v(out, mine, starts, numels), RuntimeError,
                 "passed different segment starts/numels")
    assert torch.equal(out, torch.full((8,), -1.0))
    red = torch.zeros(numels[rank])
    expect_error(lambda: comm.reduce_scatter_v(red, torch.ones(8), starts, numels), RuntimeError,
                 "passed different segment starts/numels")
    # The valid call still works after the refusals (the group is in step).
    numels = [3, 5]
    comm.all_gather_v(out, torch.full((numels[rank],), float(rank)), [0, 3], numels)
    assert out.tolist() == [0.0] * 3 + [1.0] * 5
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce_sum(t)
    assert t.item() == 3.0


def test_collective_arguments_checked():
    run_distributed(_collective_arguments, 2, timeout=60)


def test_c_surface_fuzz_never_crashes():
    """Thousands of wrong calls into _C in a subprocess: any exception is fine, a signal is not."""
    script = Path(__file__).resolve().parent.parent / "unit" / "c_surface_fuzz.py"
    proc = subprocess.run([sys.executable, "-P", str(script), "3000", "0"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (f"fuzz exited with {proc.returncode} (negative: killed by signal "
                                  f"{-proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    assert "none crashed" in proc.stdout


def test_fully_shard_frees_the_originals_without_the_garbage_collector():
    """The unsharded originals go when the units replace them, in a fresh process (the first
    fully_shard imports torch._dynamo) and with the collector off: no reference cycle of
    ours keeps device memory until the collector next runs."""
    # A fresh interpreter: the launcher's fork server preloads torch._dynamo.
    result = run_distributed(w_originals_freed_at_once, 2, timeout=120, fresh_interpreter=True)[0]
    assert result["originals"] > 0
    assert not result["dynamo_imported_before"], "torch._dynamo was imported before the first fully_shard"
