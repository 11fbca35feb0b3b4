"""Post-accumulate-grad hooks (Tensor.register_post_accumulate_grad_hook) on sharded
parameters, shared by the Gloo and NCCL suites: torchtune's optimizer-in-backward (one
SGD per parameter, stepped from its hook) trains exactly as the same hooks on one plain
process, with the hooks running once per parameter and synced backward."""
from __future__ import annotations

import contextlib
import copy
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp

from .workers import TinyStack, _full, device_for_backend, expect_error, flat_piece, gather_full_grads

STEPS = 3
MICRO_BATCHES = 3  # "accumulate": the first two without gradient sync
LR = 0.1


def _step_in_backward(model: nn.Module, calls: Dict[str, int]):
    """One SGD per parameter, stepped and zeroed from the parameter's post-accumulate-grad
    hook; `calls` counts the hook's runs per parameter name."""
    names = {p: n for n, p in model.named_parameters()}
    optimizers = {p: torch.optim.SGD([p], lr=LR) for p in model.parameters()}

    def hook(param):
        assert param.grad is not None, f"{names[param]}: the hook ran without a gradient"
        calls[names[param]] += 1
        optimizers[param].step()
        optimizers[param].zero_grad()

    return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]


def _batch(step: int, micro: int, rank: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=gen).to(device)


def optimizer_in_backward(rank: int, world: int, mode: str, chaos: bool = False) -> float:
    """mode "per_unit": one reduce-scatter per unit; "bucketed": all units in one reduce
    bucket (from the second backward on); "accumulate": per unit, the first micro-batches
    without gradient sync, so the hooks run only in the synced backward. With `chaos`
    (CUDA) the streams are delayed so that a hook reading its gradient before the
    reduction landed, or a gather reading a shard before the hook's step wrote it, gives
    wrong values. Returns the largest relative parameter error against plain PyTorch."""
    device = device_for_backend()
    torch.manual_seed(0)
    plain = TinyStack().to(device)
    initial = [p.detach().cpu().clone() for p in plain.parameters()]
    net = copy.deepcopy(plain)
    buckets = {"bucketed": 1 << 30}.get(mode, 0)
    for block in net.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(net, reduce_bucket_bytes=buckets, gather_bucket_bytes=buckets)
    ours_calls = {n: 0 for n, _ in net.named_parameters()}
    plain_calls = dict(ours_calls)
    _step_in_backward(net, ours_calls)
    _step_in_backward(plain, plain_calls)
    micro_batches = MICRO_BATCHES if mode == "accumulate" else 1
    if chaos:
        from .gpu_workers import stream_chaos
        delays = stream_chaos()
    else:
        delays = contextlib.nullcontext()
    with delays:
        for step in range(STEPS):
            for micro in range(micro_batches):
                net.set_requires_gradient_sync(micro == micro_batches - 1)
                net(_batch(step, micro, rank, device)).square().mean().backward()
            assert all(n == step + 1 for n in ours_calls.values()), \
                f"step {step}: hook runs per parameter {ours_calls}, expected {step + 1} each"
            assert all(p.grad is None for p in net.parameters()), "a hook's zero_grad did not stick"
            # Plain: one backward over the mean over ranks and sum over micro-batches.
            loss = sum(plain(_batch(step, m, r, device)).square().mean()
                       for m in range(micro_batches) for r in range(world)) / world
            loss.backward()
    assert plain_calls == ours_calls, (plain_calls, ours_calls)
    worst = 0.0
    state = net.state_dict()
    for name, p in plain.named_parameters():
        ours = _full(state[name]).detach().cpu()
        ref = p.detach().cpu()
        worst = max(worst, float((ours - ref).abs().max() / ref.abs().max()))
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    moved = max(float((p.detach().cpu() - q).abs().max()) for p, q in zip(plain.parameters(), initial))
    assert moved > 1e-3, "the parameters did not move: no hook stepped"
    return worst


def hook_error_propagates(rank: int, world: int) -> bool:
    """A hook that raises fails the backward with its own error, and training goes on
    after it like plain PyTorch's."""
    device = device_for_backend()
    torch.manual_seed(0)
    plain = TinyStack().to(device)
    net = copy.deepcopy(plain)
    for block in net.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(net)

    def boom(param):
        raise ValueError("injected hook failure")

    handles = [p.register_post_accumulate_grad_hook(boom) for p in net.parameters()]
    expect_error(lambda: net(_batch(0, 0, rank, device)).sum().backward(), ValueError, "injected hook failure")
    for h in handles:
        h.remove()
    net.zero_grad()
    net(_batch(1, 0, rank, device)).sum().backward()
    plain.zero_grad()
    (sum(plain(_batch(1, 0, r, device)).sum() for r in range(world)) / world).backward()
    full = gather_full_grads(net, replicated=False)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], flat_piece(p.grad).cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    dist.barrier()
    return True
