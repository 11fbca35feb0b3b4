"""module.to(dtype) / .half() / .float() / .double() and module.to(device) / .cpu() /
.cuda() after fully_shard: the units' shards take the new dtype or device, as FSDP2's
sharded parameters do (Hugging Face Accelerate's FSDP2 path upcasts a low-precision
model to fp32 after sharding it; RL trainers such as verl and NeMo-RL park the sharded
model in host memory with model.cpu() while the rollout engine holds the GPU, then
model.to("cuda") before the next update).

A unit keeps one dtype in C++ (its flat shard, its gather and gradient buffers, its
cast strategy), so for a dtype change it is built again over the same parameters in the
new dtype, with the same layout (alignment counts elements, so every rank's slice of
every parameter stays where it was): each rank casts its own piece, no collective. The
sharded parameter objects stay the same (their .data moves to the new unit's views), so
an optimizer built before still holds them, as under FSDP2. Supported before a unit's
first forward or unshard (lazy init builds the buffers, buckets and gradient types
around the unit's dtype). FP8/MX-gathered, tensor-parallel and CPU-offloaded units are
not rebuilt (refused by name: param_index.conversion_refused).

A device change moves only the shard (Unit.move_shard_to): the unit computes on the
device it was built for, its gathered copy is freed first (reshard), and while the
shard is elsewhere a forward raises, naming the move back. Gradients and buffers move
as nn.Module._apply moves them; the optimizer's state is the caller's to move, as under
FSDP2. CPU-offloaded units keep their shard in host memory (as FSDP2 keeps a pinned
offloaded shard on the host); FP8/MX-gathered units refuse the move.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
import torch.nn as nn

from .. import _C
from .construct import make_unit
from .extension_points import user_attributes
from .param_index import aliases_shard, conversion_refused
from . import sharded_param
from .sharded_param import set_data_unchecked
from .states import RootPhase


@dataclasses.dataclass(frozen=True)
class UnitRecipe:
    """What fully_shard built a unit from, besides its parameters: enough to build it again
    in another dtype."""

    pg: object
    alignment: int
    mp_policy: object
    strategy: object
    check_for_nan_in_grad: bool
    comm: object  # construct.CommGroups
    dims: Optional[List[int]]


def _probe(state, fn: Callable):
    """(the unit's first shard, fn of an empty tensor of its dtype and device), or None for
    a unit without parameters."""
    unit = state.unit
    if unit is None or not unit.sharded_params:
        return None
    shard = unit.sharded_params[0]
    return shard, fn(torch.empty(0, dtype=shard.dtype, device=shard.device))


def move_units(states, fn: Callable, applied_to: Callable[[], frozenset]) -> bool:
    """Move every unit in `states` whose shard `fn` would put on another device (see the
    module docstring), checking them all before moving any. `applied_to()`: the ids of the
    modules the conversion reaches, asked only for a unit of several modules (which moves
    only with all of them; a unit of one module in `states` is under the conversion).
    Returns whether `fn` changes any unit's device: then every unit is resharded first,
    so that no module slot holds a gathered parameter the conversion would cut loose."""
    targets, changes = [], False
    for state in states:
        probed = _probe(state, fn)
        if probed is None:
            continue
        shard, probe = probed
        if not isinstance(probe, torch.Tensor) or probe.device == shard.device:
            continue
        changes = True
        if _check_move(state, probe.device):
            members = state.modules
            converted = applied_to() if len(members) > 1 else ()
            outside = [m for m in members if len(members) > 1 and id(m) not in converted]
            if outside:
                raise conversion_refused(state.unit.label, shard, shard.dtype, probe.device,
                                         f"part of a unit of several modules ({type(outside[0]).__name__} "
                                         "is not under the module converted)")
            targets.append((state, probe.device))
    if changes:
        for state in states:
            if state.unit is not None:
                state.reshard()
    for state, device in targets:
        _move(state, device)
    return changes


def move_unit(state, device: torch.device) -> None:
    """Move one unit's shard to `device` (a no-op where it is, or for an offloaded unit)."""
    if _check_move(state, device):
        _move(state, device)


def _check_move(state, device: torch.device) -> bool:
    """Whether the unit's shard would move to `device`; raises for a move it cannot take."""
    unit = state.unit
    shard = unit.sharded_params[0]
    if device == shard.device or unit.offloaded:  # an offloaded shard lives in host memory by its policy
        return False
    why = None
    if device.type == "meta":
        why = "its device: the meta device holds no values (build on meta before fully_shard instead)"
    elif unit.gathers_bytes or unit.mx_block:
        why = "the device of an FP8/MX-gathered unit"
    elif aliases_shard(unit) and state.tp is not None and state.tp.specs:
        # no_shard without a cast: its tensor-parallel DTensors view the shard itself
        why = "the device of a no_shard unit holding tensor- or expert-parallel DTensors"
    elif state.ctx is not None and state.ctx.phase is not RootPhase.IDLE:
        why = "its device during backward"
    if why is not None:
        raise conversion_refused(unit.label, shard, shard.dtype, device, why)
    return True


def _move(state, device: torch.device) -> None:
    if state.ctx is not None:
        state.ctx.comm.wait_reductions()  # nothing in flight may still read or write the shard
    state.reshard()  # the gathered copy lives on the unit's device: freed, as FSDP2's _apply reshards
    state.unit.move_shard_to(device)


sharded_param.move_unit = move_unit


def _target(state, fn: Callable) -> Optional[torch.dtype]:
    """The dtype `fn` gives the unit's shards, or None when it does not change it; raises
    for a dtype change this unit cannot take. (Device changes: move_units, first.)"""
    probed = _probe(state, fn)
    if probed is None:
        return None
    shard, probe = probed
    if not isinstance(probe, torch.Tensor) or probe.dtype == shard.dtype:
        return None
    unit = state.unit
    why = None
    if not probe.dtype.is_floating_point or probe.dtype.itemsize < 2:
        why = f"a {probe.dtype} shard"
    elif state.ctx is not None:
        why = "its dtype after the unit's first forward or unshard (its buffers are built by then)"
    elif unit.gathers_bytes or unit.mx_block:
        why = "the dtype of an FP8/MX-gathered unit"
    elif unit.offloaded:
        why = "the dtype of a CPU-offloaded unit"
    elif state.tp is not None and state.tp.specs:
        why = "the dtype of a tensor-parallel unit"
    elif state.recipe is None:
        why = "the dtype of this unit"
    if why is not None:
        raise conversion_refused(unit.label, shard, probe.dtype, probe.device, why)
    return probe.dtype


def retype_units(states, fn: Callable) -> None:
    """Give every unit in `states` the dtype `fn` casts its shards to (see the module
    docstring), checking them all before changing any."""
    targets = [(s, d) for s in states for d in (_target(s, fn),) if d is not None]
    for state, dtype in targets:
        _retype(state, dtype)


def _retype(state, dtype: torch.dtype) -> None:
    old, recipe = state.unit, state.recipe
    sharded = old.sharded_params
    blanks = []
    for i, p in enumerate(sharded):
        blank = nn.Parameter(torch.empty(old.param_spec(i).shape, dtype=dtype, device="meta"),
                             requires_grad=p.requires_grad)
        for k, v in user_attributes(p).items():
            setattr(blank, k, v)
        blanks.append(blank)
    unit = make_unit(blanks, list(state.names), recipe.pg, recipe.alignment, recipe.mp_policy, recipe.strategy,
                     old.device, recipe.check_for_nan_in_grad, label=old.label)
    if recipe.dims is not None:
        unit.set_state_dict_dims(recipe.dims)
    recipe.comm.connect(unit, recipe.strategy, state.options.post_forward_shard_size)
    for setting in ("gradient_divide_factor", "requires_all_reduce", "check_collectives", "check_nonfinite"):
        setattr(unit, setting, getattr(old, setting))
    if old.comm_buffer_source != unit.comm_buffer_source:
        unit.set_comm_buffer_source(old.comm_buffer_source)
    with torch.no_grad():
        for new_view, old_view, param in zip(unit.sharded_views(), old.sharded_views(), sharded):
            new_view.copy_(old_view)  # this rank's piece, cast (a deferred unit's is unwritten either way)
            set_data_unchecked(param, new_view)
    # The same sharded objects, now over the new unit's shard: optimizers keep them.
    unit.bind_params(sharded, unit.unsharded_params)
    if old.shard_device != old.device:  # parked (model.cpu()): the new unit's shard stays there too
        unit.move_shard_to(old.shard_device)
    slots = _C.ParamSlots(unit)
    for k in range(len(state.slots)):
        slots.add(state.slots.params_dict(k), state.slots.name(k), state.slots.param_index(k))
    state.unit, state.slots = unit, slots
    state.__dict__.pop("_dtensor_mesh", None)
