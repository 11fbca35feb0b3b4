"""Which unit holds each sharded parameter, and every name a module reaches it by.

Full state dicts, sharded checkpoints and torch's state-dict protocol all translate
between parameter names (a tied parameter has several) and the (unit, index) that holds
its shard; they share this one lookup so that they agree on it. The checks that refuse
work on a unit in the wrong state (parameters unsharded, not yet materialized, a dtype or
device change) live here too, below every module that raises them.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Tuple

import weakref

import torch
import torch.nn as nn

from .states import ParamInit, SlotsHold


# Every unit of this process (weakly), for the questions asked of all of them: which
# parameters sit inside a unit's modules without being its own (shard_changes).
live_states: "weakref.WeakSet" = weakref.WeakSet()


def foreign_params(state, candidates: Dict[int, nn.Parameter]):
    """(name relative to the unit's module, parameter) of each parameter in `candidates`
    (by id) that sits in the unit's modules, outside nested units, without being the
    unit's: neither its sharded nor its unsharded parameter, nor one of its ignored_params."""
    own = {id(p) for p in state.unsharded_params} | state.ignored_param_ids
    for root in state.modules:
        if root is None:
            continue
        stack = [(root, "")]
        while stack:
            mod, prefix = stack.pop()
            if mod is not root and "_mfsdp_state" in mod.__dict__:
                continue  # a nested unit answers for its own
            for name, p in mod._parameters.items():
                if p is not None and id(p) in candidates and id(p) not in own:
                    yield prefix + name, p
            stack.extend((child, f"{prefix}{name}.") for name, child in mod._modules.items() if child is not None)


def iter_states(module: nn.Module):
    """FSDP states of `module` and its descendants, in module (pre-)order; a unit of
    several modules once, at the first of them; a unit on several meshes as its leader
    followed by its companions."""
    seen = set()
    for m in module.modules():
        state = m.__dict__.get("_mfsdp_state")
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            yield state
            yield from state.companions


def owner_of(p):
    """(unit state, index in the unit) of a sharded parameter; (None, -1) otherwise."""
    ref = getattr(p, "_mfsdp_owner", None)
    state = ref() if ref is not None else None
    if state is None or state.unit is None:
        return None, -1
    for i, q in enumerate(state.sharded_params):
        if q is p:
            return state, i
    return None, -1  # an original parameter fully_shard replaced


def by_unit(pairs: Iterable[Tuple[object, object]]) -> List[Tuple[object, Dict[int, object]]]:
    """The units holding the sharded parameters among `pairs` of (parameter, key), in
    order of first appearance, each with {parameter index in the unit: key}."""
    units: Dict[int, Tuple[object, Dict[int, object]]] = {}
    for p, key in pairs:
        state, i = owner_of(p)
        if state is not None:
            units.setdefault(id(state), (state, {}))[1][i] = key
    return list(units.values())


_ADVICE = "call it between training steps, or reshard() first"


def check_resharded(state, what: str, advice: str = _ADVICE) -> None:
    """The shards are authoritative only while the module's slots hold them, not the
    unsharded parameters installed for forward/backward."""
    if state.slots_hold is SlotsHold.UNSHARDED:
        raise RuntimeError(
            f"{what}: {state} has its unsharded parameters installed (inside forward/backward or after "
            f"unshard()); {advice}")


def reshard_for_state_dict(state, what: str, advice: str = _ADVICE) -> None:
    """State dicts and loads work on the shards. Unsharded parameters installed outside
    backward (the root after a forward no backward followed yet, or after unshard()) are
    put back first, as FSDP2 does (its state-dict hooks call _to_sharded): the next use
    gathers again, a backward's too. Inside backward it raises (check_resharded)."""
    ctx = state.ctx
    if state.slots_hold is SlotsHold.UNSHARDED and ctx is not None and not ctx.in_backward:
        state.release()
    check_resharded(state, what, advice)


def aliases_shard(unit) -> bool:
    """Whether the unit's unsharded parameters are its shard itself (a replicated strategy
    without a cast: nothing is ever gathered), as C++ Unit::aliases_shard decides."""
    return unit.strategy.replicated and unit.gather_transform.name == "NONE"


def same_slot(value: torch.Tensor, current: torch.Tensor) -> bool:
    """Whether `value` is `current`'s memory (the same storage from the same element), as
    C++ Unit::views_its_slot decides: empty tensors by their storage alone, whose data
    pointer is null alike for every empty tensor."""
    if value.untyped_storage()._cdata != current.untyped_storage()._cdata:
        return False
    return value.numel() == 0 or value.storage_offset() == current.storage_offset()


def conversion_refused(unit_label: str, shard: torch.Tensor, to_dtype, to_device, what: str = "") -> RuntimeError:
    """The error for a dtype or device change a unit's shards cannot take (`what`: the
    change, when only some are refused): a device change, or a dtype change of a module
    inside a unit (model.norm.float()) rather than of the unit's module, or of a unit
    retype.py does not rebuild. The unit's flat buffers keep one dtype and device, and
    would copy the converted values back and train as before."""
    which = (f"{what}: " if what else "") + "the unit's flat buffers keep one dtype and device"
    return RuntimeError(
        f"megatron_fsdp_ext: fully_shard unit '{unit_label}' cannot change its sharded parameters from "
        f"{shard.dtype} on {shard.device} to {to_dtype} on {to_device} (module.double(), .half(), .float(), "
        ".to(), .cuda(), .cpu() or .to_empty() after fully_shard, on the unit's module or a module inside it), "
        f"{which}. A whole unit moves with .to(device), .cpu() or .cuda() on its own module (or an ancestor's), "
        "and its dtype changes there before its first forward; otherwise move the model (or cast that module) "
        "before fully_shard; for a compute dtype use "
        "MixedPrecisionPolicy(param_dtype=...); for a model built on the meta device use "
        "megatron_fsdp_ext.materialize(model)")


def check_materialized(states, what: str) -> None:
    """Units built on the meta device hold no values until materialize() ran."""
    deferred = [s for s in states if s.param_init is ParamInit.DEFERRED]
    if deferred:
        names = ", ".join(str(s) for s in deferred[:3]) + (f" and {len(deferred) - 3} more" if len(deferred) > 3 else "")
        raise RuntimeError(
            f"{what}: {names} {'was' if len(deferred) == 1 else 'were'} built on the meta device and "
            "hold no parameter values yet; call megatron_fsdp_ext.materialize(model) (or load_full_state_dict / "
            "load_safetensors) after fully_shard first")


class Param(NamedTuple):
    state: object  # the FSDPState of the unit
    index: int  # in the unit's sharded_params
    names: List[str]  # in named_parameters() order: tied parameters have several


class ParamIndex:
    """The units of `module` (each checked with check_resharded) and its sharded
    parameters: `params` maps id(sharded parameter) to its Param, `names` maps id() of
    every parameter of `module` to its names."""

    def __init__(self, module: nn.Module, what: str, advice: str = _ADVICE, *, loading: bool = False):
        self.states = [s for s in iter_states(module) if s.unit is not None]
        # A module inside a unit, not a unit itself (`model.inner`, what PEFT's
        # merge_and_unload returns), holds parameters of the unit around it: that unit
        # serves them too (its parameters outside `module` have no names here).
        seen = {id(s) for s in self.states}
        for p in module.parameters():
            ref = getattr(p, "_mfsdp_owner", None)
            state = ref() if ref is not None else None
            # owner_of (a search of the unit) only for a unit not yet listed: it also tells
            # a sharded parameter from an original it replaced, which points there too.
            if state is not None and id(state) not in seen and owner_of(p)[0] is state:
                seen.add(id(state))
                self.states.append(state)
        for state in self.states:  # an overlapped optimizer step may still write the shards
            state.unit.wait_host_update()
        if not loading:  # a load is one way to give deferred units their values
            check_materialized(self.states, what)
        for state in self.states:
            reshard_for_state_dict(state, what, advice)
        self.names: Dict[int, List[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
        self.params: Dict[int, Param] = {
            id(p): Param(state, i, self.names[id(p)])
            for state in self.states for i, p in enumerate(state.sharded_params) if id(p) in self.names
        }

    def names_of(self, p) -> List[str]:
        return self.names.get(id(p), [])
