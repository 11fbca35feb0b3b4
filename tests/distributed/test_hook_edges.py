"""Edges of the unit hooks on Gloo: tensor subclasses through the post-backward marker,
and recovery from a backward that raised."""
import copy

import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from harness import run_distributed
from harness.workers import TinyStack, expect_error, flat_piece, gather_full_grads


class Tagged(torch.Tensor):
    """A subclass with only __torch_function__ (the default one keeps the type)."""


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append(type(x))
        return torch.tanh(self.lin(x))


def _sharded_and_plain(**root_options):
    torch.manual_seed(0)
    plain = TinyStack(_Block)
    net = copy.deepcopy(plain)
    for b in net.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net, **root_options)
    return net, plain


def _grads_match(net, plain):
    """The sharded model's gradients (gathered from every rank's shards) equal the plain
    model's; every rank trained on the same batch, so the mean over ranks is that batch's."""
    full = gather_full_grads(net, replicated=False)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], flat_piece(p.grad), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _subclass_inputs(rank, world):
    net, plain = _sharded_and_plain()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    tagged = x.clone().as_subclass(Tagged).requires_grad_()
    net(tagged).sum().backward()
    # The first block takes the input itself; the others take outputs derived from it.
    assert all(t is Tagged for b in net.blocks for t in b.seen), [b.seen for b in net.blocks]
    plain(x).sum().backward()
    _grads_match(net, plain)
    assert tagged.grad is not None


def _recovers_from_failed_backward(rank, world):
    net, plain = _sharded_and_plain()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def boom(grad):
        raise ValueError("injected backward failure")

    out = net(x)
    out.register_hook(boom)
    expect_error(lambda: out.sum().backward(), ValueError, "injected backward failure")
    for p in net.parameters():
        p.grad = None
    # The next step: the forward frees every block after use again (reshard after forward
    # needs the backward state reset) and the gradients are those of plain PyTorch.
    out = net(x)
    assert all(b._fsdp_state.unit.state == b._fsdp_state.unit.state.SHARDED for b in net.blocks)
    out.sum().backward()
    assert not net._fsdp_state.ctx.in_backward
    plain(x).sum().backward()
    _grads_match(net, plain)


def test_tensor_subclass_inputs_keep_their_type_through_the_marker():
    run_distributed(_subclass_inputs, 2, timeout=120)


def test_training_goes_on_after_a_backward_that_raised():
    run_distributed(_recovers_from_failed_backward, 2, timeout=120)


def _held_gradients_dropped_after_failed_backward(rank, world):
    """With one reduce bucket for all units, blocks 2 and 1 are held after their backward
    (waiting for the root's post-backward in the final callback) when a hook on block 0's
    output raises. The next step must not add their stranded gradients to its own."""
    net, plain = _sharded_and_plain(reduce_bucket_bytes=1 << 30)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    net(x).sum().backward()  # records the forward order: buckets from the next step
    for p in net.parameters():
        p.grad = None

    def boom(grad):
        raise ValueError("injected backward failure")

    def raise_in_backward(module, args, out):
        out.register_hook(boom)

    handle = net.blocks[0].register_forward_hook(raise_in_backward)
    expect_error(lambda: net(x).sum().backward(), ValueError, "injected backward failure")
    handle.remove()
    held = net._fsdp_state.ctx.schedule.held.get(0, [])
    assert [s.module for s in held] == [net.blocks[2], net.blocks[1]], f"expected blocks 2 and 1 held, got {held}"
    for p in net.parameters():
        p.grad = None
    net(x).sum().backward()
    assert not net._fsdp_state.ctx.schedule.held, "a bucket is still held after the backward ended"
    plain(x).sum().backward()
    _grads_match(net, plain)


def test_held_bucket_gradients_are_dropped_after_a_backward_that_raised():
    run_distributed(_held_gradients_dropped_after_failed_backward, 2, timeout=120)


def _bucket_with_a_member_not_syncing(rank, world):
    """One reduce bucket for all units; in the first micro-batch the root alone does not
    sync. It finishes last (in the final callback) without asking for a reduction, so the
    bucket is reduced after the loop; its own gradient accumulates locally and is reduced
    with the second micro-batch. Every gradient equals plain PyTorch's over both."""
    net, plain = _sharded_and_plain(reduce_bucket_bytes=1 << 30)
    gen = torch.Generator().manual_seed(4)
    x0, x1, x2 = (torch.randn(4, 8, generator=gen) for _ in range(3))
    net(x0).sum().backward()  # records the forward order: buckets from the next step
    for p in net.parameters():
        p.grad = None
    net.set_requires_gradient_sync(False, recurse=False)
    net(x1).sum().backward()
    assert all(b.weight.grad is not None for b in (blk.lin for blk in net.blocks)), "the blocks were not reduced"
    assert net.head.weight.grad is None, "the root reduced without sync"
    net.set_requires_gradient_sync(True, recurse=False)
    net(x2).sum().backward()
    for x in (x1, x2):
        plain(x).sum().backward()
    _grads_match(net, plain)


def test_bucket_whose_last_member_does_not_sync_is_still_reduced():
    run_distributed(_bucket_with_a_member_not_syncing, 2, timeout=120)
