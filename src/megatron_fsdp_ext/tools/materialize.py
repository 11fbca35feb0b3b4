"""Deferred (meta-device) initialization.

A model built under torch.device("meta") and sharded with fully_shard holds only its
shards, allocated but without values (NaN). materialize() gives them their values by
running each module's initializer on temporary full-size parameters, one module at a
time, and keeping this rank's slice: no rank ever holds more than its shards plus one
module's full parameters.

Modules are visited in module pre-order, the order torch.nn-style models construct (and
so initialize) their leaf modules, and each runs on the device its unit lives on: with
the same seed, the values equal those of the model built directly on that device, for
any world size and sharding strategy. A parameter shared by several modules (tied
weights) keeps the value of the first module that holds it; the later holders run their
initializer on a scratch tensor, so that the random number generator advances as it did
when the model was built (and tied afterwards).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.nn as nn

from ..core.param_index import iter_states, owner_of
from ..core.states import ParamInit, SlotsHold
from ..core.dtensor_face import is_dtensor


def _blank(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Full-size storage for an initializer; NaN where it can be, so one that skips a
    tensor (or part of it) is caught instead of leaving garbage."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _unwritten(t: torch.Tensor) -> bool:
    # A NaN left anywhere makes the sum NaN; no full-size mask is allocated.
    return (t.dtype.is_floating_point or t.dtype.is_complex) and t.numel() > 0 and bool(t.sum().isnan())


def materialize(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """Initialize a model that was built on the meta device and sharded with fully_shard.

    For every submodule (pre-order) that directly holds parameters of a deferred unit,
    meta parameters outside any unit (ignored_params) or meta buffers, those tensors are
    allocated in full on the unit's device, `init_fn(submodule)` runs on them (default:
    `submodule.reset_parameters()`, torch.nn's convention), and this rank keeps its slice
    of each parameter; buffers and ignored parameters are kept whole. Collective-free:
    every rank runs the same initializers and keeps its own part. Returns `module`.

    An initializer must write every element of the module's own parameters and buffers
    (not those of other modules); a module that holds such tensors but has no
    reset_parameters() needs `init_fn`. Either mistake raises, naming the module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"materialize expects an nn.Module, got {type(module).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be callable (called with each module), got {type(init_fn).__name__}")
    states = [s for s in iter_states(module) if s.unit is not None]
    deferred = {id(s): s for s in states if s.param_init is ParamInit.DEFERRED}
    meta_left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if not deferred and not meta_left:
        raise ValueError(
            f"materialize({type(module).__name__}): nothing to initialize: no fully_shard unit of it was built on "
            "the meta device and it holds no meta tensors (running the initializers again would overwrite its "
            "values)")
    devices = {s.unit.device for s in (deferred.values() or states)}
    if len(devices) != 1:
        raise ValueError(f"materialize: the units are on {sorted(map(str, devices))}; expected one device"
                         if devices else
                         f"materialize({type(module).__name__}): meta tensors {meta_left[:3]} but no fully_shard "
                         "unit to take the device from; call fully_shard first")
    device = next(iter(devices))
    for s in deferred.values():
        if s.slots_hold is not SlotsHold.SHARDED:
            raise RuntimeError(f"materialize: {s} has its unsharded parameters installed; call it before training")
        loaded = s.loaded_while_deferred
        if loaded:
            # Its initializers would overwrite what load_state_dict() wrote (a load covering
            # the whole unit would have marked it loaded).
            raise RuntimeError(
                f"materialize: load_state_dict() (or to_empty() on a module inside the unit) wrote "
                f"{sorted(s.names[i] for i in loaded)[:5]} of {s} but not "
                f"{sorted(s.names[i] for i in range(len(s.names)) if i not in loaded)[:5]}; materialize would "
                "overwrite the loaded values. Load (or to_empty()) every parameter of the unit, or call "
                "materialize(model) before loading")

    written = set()  # (id(state), index in the unit) whose shard holds its value
    for path, m in module.named_modules():
        written |= _initialize_module(m, path, init_fn, deferred, written, states, device)
    missing = [s.names[i] for s in deferred.values() for i in range(len(s.names)) if (id(s), i) not in written]
    if missing:
        raise RuntimeError(f"materialize: no module of {type(module).__name__} holds parameter(s) {missing[:5]}; "
                           "they were left without values")
    for s in deferred.values():
        s.mark_loaded()
    return module


def _initialize_module(m: nn.Module, path: str, init_fn, deferred: dict, written: set, states: List,
                       device: torch.device) -> set:
    """Run `m`'s initializer on full-size copies of its own deferred tensors; returns the
    (unit, index) pairs whose shards it wrote."""
    where = path or type(m).__name__
    swaps = []  # (slot name, sharded parameter, full tensor, state, index, scratch)
    fresh = []  # (dict, name, tensor): meta tensors replaced for good (buffers, ignored parameters)
    for name, p in m._parameters.items():
        if p is None:
            continue
        state, i = owner_of(p)
        if state is not None:
            if id(state) in deferred:
                spec = state.unit.param_spec(i)
                full = _blank(spec.shape, spec.dtype, device)
                if state.tp is not None and i in state.tp.specs:
                    # The initializer sees the DTensor TP alone gives (its local part: this
                    # rank's TP shard), as it would on the model built without fully_shard.
                    full = state.tp.full_of_local(i, full)
                swaps.append((name, p, full, state, i, (id(state), i) in written))
        elif p.is_meta:
            fresh.append((m._parameters, name, nn.Parameter(_blank(p.shape, p.dtype, device), p.requires_grad)))
    for name, b in m._buffers.items():
        if b is not None and b.is_meta:
            fresh.append((m._buffers, name, _blank(b.shape, b.dtype, device)))
    if not swaps and not fresh:
        return set()
    init = init_fn
    if init is None:
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            held = [f"{where}.{n}" for n, *_ in swaps] + [f"{where}.{n}" for _, n, _ in fresh]
            raise ValueError(
                f"materialize: module '{where}' ({type(m).__name__}) holds {held[:4]} but has no reset_parameters(); "
                "pass init_fn=, called with each module, to initialize its tensors")
        init = lambda _: reset()  # noqa: E731

    for name, _, full, *_ in swaps:
        m._parameters[name] = nn.Parameter(full, requires_grad=False)
    for table, name, t in fresh:
        table[name] = t
    versions = [s.unit.sharded_flat._version for s in states]
    try:
        with torch.no_grad():
            init(m)
    finally:
        for name, p, *_ in swaps:
            m._parameters[name] = p
    touched = [s for s, v in zip(states, versions) if s.unit.sharded_flat._version != v]
    if touched:
        raise RuntimeError(
            f"materialize: the initializer of '{where}' ({type(m).__name__}) wrote to parameters of {touched[0]} "
            "that it does not hold directly; an initializer must only set the module's own parameters and buffers "
            "(torch.nn's reset_parameters convention)")
    swaps = [(name, p, full.to_local() if is_dtensor(full) else full, *rest)
             for name, p, full, *rest in swaps]
    for name, _, full, state, _, scratch in swaps:
        if not scratch and _unwritten(full):
            raise RuntimeError(f"materialize: the initializer of '{where}' ({type(m).__name__}) left parameter "
                               f"'{where}.{name}' (or part of it) unset")
    for table, name, t in fresh:
        if _unwritten(t):
            kind = "buffer" if table is m._buffers else "parameter"
            raise RuntimeError(f"materialize: the initializer of '{where}' ({type(m).__name__}) left {kind} "
                               f"'{where}.{name}' (or part of it) unset; buffers computed in __init__ must be "
                               "computed again by reset_parameters() or init_fn")
    done = set()
    for _, _, full, state, i, scratch in swaps:
        if not scratch:
            state.unit.shard_changed(i, full)  # keeps this rank's slice; no collective
            done.add((id(state), i))
    return done
