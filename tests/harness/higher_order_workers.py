"""Higher-order gradients through sharded units: a gradient penalty (WGAN-GP, R1) takes
torch.autograd.grad(loss, input, create_graph=True) and then backward() through both
the model's graph and the graph that autograd.grad built, which reads the gathered
parameters again. Checked against the same steps on one plain process, gradients before
every optimizer step."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp

from .workers import TinyStack, device_for_backend, expect_error, flat_piece, gather_full_grads

STEPS = 3
PENALTY = 10.0
LR = 0.05


class _TanhBlock(nn.Module):
    """tanh, not relu: its second derivative is not zero, so the penalty's gradient
    depends on the weights through both graphs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _batch(step: int, rank: int, kind: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + kind)
    return torch.randn(4, 8, generator=gen).to(device)


def _penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    return (gx.norm(dim=1) - 1).square().mean()


def _loss(model: nn.Module, step: int, rank: int, device, mode: str) -> torch.Tensor:
    """One rank's WGAN-GP-style critic loss. "forward_after": the second critic forward
    runs after the penalty's autograd.grad, so a unit releases its gathered parameters
    between the penalty's graph and its backward."""
    real, fake, mixed = (_batch(step, rank, k, device) for k in range(3))
    if mode == "forward_after":
        penalty = _penalty(model, mixed)
        return model(fake).mean() - model(real).mean() + PENALTY * penalty
    critic = model(fake).mean() - model(real).mean()
    return critic + PENALTY * _penalty(model, mixed)


def _shard(net: nn.Module, mode: str) -> None:
    reshard = mode != "no_reshard"
    buckets = 1 << 30 if mode == "bucketed" else 0
    for block in net.blocks:
        mfsdp.fully_shard(block, reshard_after_forward=reshard)
    mfsdp.fully_shard(net, reduce_bucket_bytes=buckets, gather_bucket_bytes=buckets)


def gradient_penalty(rank: int, world: int, mode: str, chaos: bool = False) -> bool:
    """mode: "per_unit", "no_reshard" (reshard_after_forward=False), "bucketed" (one
    reduce bucket), "forward_after" (a forward between the penalty and the backward),
    "metric_first" (step 0 takes the penalty's gradient for a metric only and backward
    through the critic loss alone: the held units must still reduce). With `chaos`
    (CUDA) the side streams are delayed, so a held unit reduced before the penalty
    graph's gradients landed, or memory freed under that graph, gives wrong values."""
    device = device_for_backend()
    torch.manual_seed(0)
    plain = TinyStack(_TanhBlock).to(device)
    net = copy.deepcopy(plain)
    _shard(net, mode)
    ours_opt = torch.optim.SGD(net.parameters(), lr=LR)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    if chaos:
        from .gpu_workers import stream_chaos
        delays = stream_chaos()
    else:
        delays = contextlib.nullcontext()
    with delays:
        _train(net, plain, ours_opt, plain_opt, rank, world, device, mode)
    return True


def _train(net, plain, ours_opt, plain_opt, rank: int, world: int, device, mode: str) -> None:
    for step in range(STEPS):
        if mode == "metric_first" and step == 0:
            _penalty(net, _batch(step, rank, 2, device)).item()
            (net(_batch(step, rank, 1, device)).mean() - net(_batch(step, rank, 0, device)).mean()).backward()
            plain_loss = sum(plain(_batch(step, r, 1, device)).mean() - plain(_batch(step, r, 0, device)).mean()
                             for r in range(world)) / world
        else:
            _loss(net, step, rank, device, mode).backward()
            plain_loss = sum(_loss(plain, step, r, device, mode) for r in range(world)) / world
        plain_loss.backward()
        full = gather_full_grads(net, replicated=False)
        for name, p in plain.named_parameters():
            torch.testing.assert_close(full[name], flat_piece(p.grad).cpu(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, step=step: f"step {step}, grad of {name}: {m}")
        ours_opt.step()
        plain_opt.step()
        ours_opt.zero_grad()
        plain_opt.zero_grad()


def create_graph_into_parameters_is_refused(rank: int, world: int) -> bool:
    """backward(create_graph=True) writes gradients with a graph into the parameters: no
    reduce-scatter can carry that graph, so it is refused by name; training goes on."""
    device = device_for_backend()
    torch.manual_seed(0)
    plain = TinyStack(_TanhBlock).to(device)
    net = copy.deepcopy(plain)
    _shard(net, "per_unit")
    expect_error(lambda: net(_batch(0, rank, 0, device)).sum().backward(create_graph=True),
                 NotImplementedError, "create_graph=True", "torch.autograd.grad")
    net.zero_grad()
    net(_batch(1, rank, 0, device)).sum().backward()
    (sum(plain(_batch(1, r, 0, device)).sum() for r in range(world)) / world).backward()
    full = gather_full_grads(net, replicated=False)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], flat_piece(p.grad).cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return True
