"""check_for_nan_in_grad: a NaN or Inf gradient stops the step, on every rank, named.

Units with the check on test every reduced gradient shard on the device (one fused
kernel per unit or bucket, on the reduce-scatter stream, into their context's flag:
csrc CommContext::check_nonfinite); nothing waits for it. optimizer.step() (a global
step pre-hook) and clip_grad_norm_ read the flags once: one small all-reduce (MAX) over
the units' process groups and one host read, so every rank refuses alike. Only when
something was found are the gradients searched, to name the rank, unit and parameter.
"""
from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist

from .agree import gather_objects, listing, rank_world


class NonFiniteGradientError(RuntimeError):
    """A checked unit's reduced gradient held NaN or Inf; the step was not taken."""


def _checked(states: Iterable) -> List:
    return [s for s in states if s is not None and s.unit is not None and s.unit.check_nonfinite
            and s.ctx is not None]


def check_nonfinite_grads(states: Iterable, what: str) -> None:
    """Collective over the checked units' process groups: raise NonFiniteGradientError on
    every rank if any checked unit's reduced gradients held NaN/Inf since the last check
    (the flags are reset either way)."""
    checked = _checked(states)
    if not checked:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what}: check_for_nan_in_grad reads a device flag on the host at this call, which a CUDA graph "
            "capture cannot do; capture the step without it and call "
            "megatron_fsdp_ext.check_for_nan_in_grad(model) after each replay")
    contexts = list({id(s.ctx.comm): s.ctx.comm for s in checked}.values())
    flags = [c.nonfinite_flag for c in contexts if c.nonfinite_flag is not None]
    device = checked[0].unit.device
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for f in flags:
        found += f
        f.zero_()
    groups = list({id(s.check_group): s.check_group for s in checked}.values())
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    if found.item() == 0:  # the check's one host synchronization
        return
    where = []
    with torch._C.DisableTorchFunctionSubclass():  # this rank's pieces: its own findings, no collective
        for s in checked:
            for name, p in zip(s.names, s.sharded_params):
                g = p.grad
                if g is not None and not bool(torch.isfinite(g).all()):
                    kind = "NaN" if bool(torch.isnan(g).any()) else "Inf"
                    where.append(f"unit '{s.label}' parameter '{name}' ({kind})")
                    break
    infos = {}
    for group in groups:
        infos.update(gather_objects(where, group))
    bad = {r: "; ".join(w) for r, w in sorted(infos.items()) if w}
    rank = rank_world()[0]
    raise NonFiniteGradientError(
        f"{what} refused on rank {rank}: non-finite gradients (check_for_nan_in_grad) after the reduction on "
        f"rank(s) {sorted(bad) or '(none found in the shards: a later write cleared it)'}: {listing(bad)}. "
        "The step was not taken: zero the gradients and skip this batch, or find the cause (learning rate, "
        "data, loss scale)")


def check_for_nan_in_grad(module) -> None:
    """Run the check_for_nan_in_grad test of `module`'s units now (collective), e.g.
    after replaying a captured CUDA graph, where optimizer.step() cannot read the flag."""
    from .param_index import iter_states

    check_nonfinite_grads(iter_states(module), "check_for_nan_in_grad")
