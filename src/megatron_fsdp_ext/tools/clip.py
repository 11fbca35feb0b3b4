"""Gradient clipping over sharded and replicated parameters."""
from __future__ import annotations

import math
from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.dtensor_face import local_numel
from ..core.grad_norm import all_reduce_power_sum, combine_power_sums, local_power_sum, norm_of_power_sum
from ..core.nonfinite import check_nonfinite_grads


def clip_grad_norm_(
    parameters: Union[nn.Module, Iterable[torch.Tensor], torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by their global norm, like torch.nn.utils.clip_grad_norm_, where
    the norm of sharded gradients is combined across the shards' process group and
    replicated (unsharded) parameters are counted once; under tensor parallelism the norm
    is global over dp x tp, a parameter replicated over tp counted once. Returns the total norm. Units
    with check_for_nan_in_grad refuse NaN/Inf gradients here first (on every rank)."""
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):  # one tensor, as torch's accepts (not its rows)
        params = [parameters]
    else:
        params = list(parameters)
    norm_type = float(norm_type)
    owners = {id(o()): o() for o in (getattr(p, "_mfsdp_owner", None) for p in params) if o is not None}
    for state in owners.values():  # an overlapped optimizer step may still read the gradients
        if state is not None and state.unit is not None:
            state.unit.wait_host_update()
    check_nonfinite_grads(owners.values(), "clip_grad_norm_")
    # Each gradient is sharded over the data-parallel ranks (a unit's shard) or whole on
    # each (replicated strategies, parameters outside any unit); under tensor parallelism
    # it is also split over the tp ranks (a TP-sharded parameter) or the same on each of
    # them (a replicated one, e.g. a norm weight), which then counts on tp rank 0 only.
    sharded, replicated, groups, tp_groups = [], [], {}, {}
    tp_split = set()  # ids of the gradients split over tp
    tp_index = {}  # per TP unit: id(sharded parameter) -> its index
    for p in params:
        if p.grad is None:
            continue
        owner = getattr(p, "_mfsdp_owner", None)
        state = owner() if owner is not None else None
        if state is not None and state.unit is None:
            state = None
        if state is not None and state.tp is not None:
            tp_groups[tuple(dist.get_process_group_ranks(state.tp.tp_group))] = state.tp.tp_group
            if id(state) not in tp_index:
                tp_index[id(state)] = {id(q): i for i, q in enumerate(state.sharded_params)}
            spec = state.tp.specs.get(tp_index[id(state)].get(id(p), -1))
            if spec is not None and spec.sharded:
                tp_split.add(id(p.grad))
        if state is not None and state.unit.strategy.replicated:
            replicated.append(p.grad)  # every rank holds the whole (all-reduced) gradient
        elif state is not None:
            groups[id(state.process_group)] = state.process_group
            sharded.append(p.grad)
        else:
            replicated.append(p.grad)
    if len(groups) > 1 or len(tp_groups) > 1 or norm_type == 0:
        # Several reduction domains (MoE experts on the expert mesh beside dense parameters,
        # or units on different groups): torch's clip over the gradients' ShardedGrad types
        # reduces each domain's sum over its own groups (grad_norm.py), as FSDP2's DTensor
        # norms would per mesh. So does order 0, which counts the gradients with a nonzero
        # element: each gradient's count is global before it is counted.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    tp_group = next(iter(tp_groups.values()), None)
    counts_replicated = tp_group is None or dist.get_rank(tp_group) == 0
    grads = sharded + replicated
    if not grads:
        return torch.tensor(0.0)
    # Where the norm is combined: the units' device (offloaded units hold host gradients,
    # which a device backend cannot reduce), else the gradients' own.
    device = next((torch.device(o.unit.device) for o in owners.values() if o.unit is not None), grads[0].device)
    idempotent = math.isinf(norm_type)  # a max or min counts a repeated gradient once by itself

    def local(gs):
        if not idempotent and not counts_replicated:
            gs = [g for g in gs if id(g) in tp_split]  # the tp-replicated ones count on tp rank 0
        gs = [g for g in gs if local_numel(g) > 0]  # empty shards add nothing (and inf-norm on empties raises)
        norms = [n for same in _by_device(gs).values() for n in torch._foreach_norm(same, norm_type)]
        stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]) if norms else \
            torch.zeros(0, device=device, dtype=torch.float32)
        return local_power_sum(stacked, norm_type)

    # The gradients' ShardedGrad type would reduce their norms across ranks by itself
    # (grad_norm.py); here the reduction is explicit, so they count as plain tensors.
    with torch._C.DisableTorchFunctionSubclass():
        shard_part = local(sharded)
        if groups:
            shard_part = all_reduce_power_sum(shard_part, norm_type, next(iter(groups.values())))
        combined = combine_power_sums(shard_part, local(replicated), norm_type)
        if tp_group is not None:
            combined = all_reduce_power_sum(combined, norm_type, tp_group)
        total = norm_of_power_sum(combined, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({total.item()})"
            )
        clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for dev, same in _by_device(grads).items():
            torch._foreach_mul_(same, clip_coef.to(device=dev, dtype=same[0].dtype))
        return total


def _by_device(tensors):
    """The tensors grouped by device (offloaded units' gradients live on the host)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups
