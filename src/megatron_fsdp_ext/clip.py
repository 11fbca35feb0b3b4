"""Gradient clipping over sharded and replicated parameters."""
from __future__ import annotations

from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .nonfinite import check_nonfinite_grads


def clip_grad_norm_(
    parameters: Union[nn.Module, Iterable[torch.Tensor], torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by their global norm, like torch.nn.utils.clip_grad_norm_, where
    the norm of sharded gradients is combined across the shards' process group and
    replicated (unsharded) parameters are counted once. Returns the total norm. Units
    with check_for_nan_in_grad refuse NaN/Inf gradients here first (on every rank)."""
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):  # one tensor, as torch's accepts (not its rows)
        params = [parameters]
    else:
        params = list(parameters)
    norm_type = float(norm_type)
    owners = {id(o()): o() for o in (getattr(p, "_mfsdp_owner", None) for p in params) if o is not None}
    check_nonfinite_grads(owners.values(), "clip_grad_norm_")
    sharded, replicated, groups = [], [], {}
    for p in params:
        if p.grad is None:
            continue
        owner = getattr(p, "_mfsdp_owner", None)
        state = owner() if owner is not None else None
        if state is not None and state.unit is not None and state.unit.strategy.replicated:
            replicated.append(p.grad)  # every rank holds the whole (all-reduced) gradient
        elif state is not None:
            groups[id(state.process_group)] = state.process_group
            sharded.append(p.grad)
        else:
            replicated.append(p.grad)
    if len(groups) > 1:
        raise ValueError(
            "clip_grad_norm_: parameters are sharded over different process groups; "
            "clip each group's parameters separately"
        )
    grads = sharded + replicated
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device

    def local(gs):
        gs = [g for g in gs if g.numel() > 0]  # empty shards (and inf-norm on empties raises)
        if not gs:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch._foreach_norm(gs, norm_type)
        stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
        return stacked.max() if norm_type == float("inf") else (stacked ** norm_type).sum()

    shard_part = local(sharded)
    if groups:
        pg = next(iter(groups.values()))
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        dist.all_reduce(shard_part, op=op, group=pg)
    rep_part = local(replicated)
    if norm_type == float("inf"):
        total = torch.maximum(shard_part, rep_part)
    else:
        total = (shard_part + rep_part) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({total.item()})"
        )
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
    return total
