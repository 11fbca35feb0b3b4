"""Full (unsharded) state dicts that load into the plain, unwrapped nn.Module."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .agree import digest, failures, gather_objects, raise_agreed, rank_world
from .param_index import iter_states
from .param_index import ParamIndex
from .state_dict import local_state_dict


def _param_index(module: nn.Module) -> ParamIndex:
    return ParamIndex(module, "full state dict", "call it between training steps or reshard() first")


def full_state_dict(module: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict:
    """Gather every sharded parameter in full precision. Collective: call on all ranks.

    Returns the full state dict (same keys as the unwrapped module's) on global rank 0
    (also for a model sharded over a subgroup), or on every rank with rank0_only=False;
    other ranks get {}.
    """
    index = _param_index(module)
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = (not rank0_only) or rank == 0
    with local_state_dict():  # sharded entries are replaced by the gathered values below
        sd = module.state_dict()
    for state in index.states:
        full = state.unit.gather_full_params()
        for p, t in zip(state.sharded_params, full):
            for key in index.names_of(p):
                if keep:
                    sd[key] = t.detach().cpu() if cpu_offload else t.detach().clone()
    if not keep:
        return {}
    if cpu_offload:
        sd = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    return sd


def _agree_on_keys(module: nn.Module, state_dict: dict, own: Optional[BaseException]) -> None:
    """Every rank that shares a unit's process group must pass the same keys (so that all
    issue the same all-gathers) and must have passed the local checks: one small
    collective per process group (usually one) tells, and every rank raises alike."""
    groups = []
    if dist.is_available() and dist.is_initialized():
        for state in iter_states(module):
            if state.unit is not None and state.process_group is not None and \
                    all(g is not state.process_group for g in groups):
                groups.append(state.process_group)
    keys = sorted(state_dict)
    mine = (digest(keys), failures(own, rank_world()[0]))
    for group in groups:
        seen = gather_objects(mine, group)
        if len({d for d, _ in seen.values()}) > 1:
            sets = {r: set(k) for r, k in gather_objects(keys, group).items()}  # only on this error path
            first = min(k for k in set().union(*sets.values()) if not all(k in s for s in sets.values()))
            have = [r for r, s in sets.items() if first in s]
            lack = [r for r, s in sets.items() if first not in s]
            raise ValueError(
                f"load_full_state_dict: the ranks passed different keys: '{first}' is in the state dict of "
                f"rank(s) {have} but not of rank(s) {lack}; every rank must pass the same keys (nothing was loaded)"
            )
        raise_agreed("load_full_state_dict", own, [f for _, f in seen.values()], tail="; nothing was loaded")
    if own is not None:
        raise own


def load_full_state_dict(module: nn.Module, state_dict: dict, *, strict: bool = True) -> None:
    """Load a full (unsharded) state dict, as saved from the plain module or by
    full_state_dict(), into a sharded module. Every rank passes the full dict, with the
    same keys (an error on every rank otherwise, naming the first key that differs).
    Everything is checked before anything is loaded; with strict=False, parameters
    absent from the dict keep their values."""
    plan, own = None, None
    try:
        plan = _plan_full_load(module, state_dict, strict)
    except Exception as e:
        own = e
    _agree_on_keys(module, state_dict, own)
    states, fulls, replicated = plan
    # Every rank of a unit's group gathers the same units (the keys agree).
    for state, full in zip(states, fulls):
        if any(t is None for t in full):
            current = state.unit.gather_full_params()
            full = [c if t is None else t for c, t in zip(current, full)]
        state.unit.load_full_params(full)
    with torch.no_grad():
        for target, value in replicated:
            target.copy_(value)


def _plan_full_load(module: nn.Module, state_dict: dict, strict: bool):
    """The local checks, no collective: returns the units, each one's full tensors (None
    where the dict lacks a parameter) and the replicated (target, value) pairs."""
    index = _param_index(module)
    for state in index.states:
        state.reshard()  # an early all-gather (start_param_sync) would now be stale
    with local_state_dict():
        own = module.state_dict()  # the replicated entries below are copied into these
    expected = set(own)
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise KeyError(
            "load_full_state_dict: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected keys {unexpected}" if unexpected else "")
        )
    fulls = []
    for state in index.states:
        full = []
        for p, u, name in zip(state.sharded_params, state.unsharded_params, state.names):
            keys = [k for k in index.names_of(p) if k in state_dict]
            if not keys:
                if strict:
                    raise KeyError(f"load_full_state_dict: missing key for parameter '{name}'")
                full.append(None)
                continue
            value = state_dict[keys[0]]
            if tuple(value.shape) != tuple(u.shape):
                raise ValueError(
                    f"load_full_state_dict: '{keys[0]}' has shape {tuple(value.shape)}, "
                    f"expected {tuple(u.shape)}"
                )
            full.append(value.detach().to(device=state.unit.device, dtype=state.unit.orig_dtype))
        fulls.append(full)
    # Everything else (buffers, ignored/unsharded parameters) is replicated: copied.
    sharded_keys = {k for param in index.params.values() for k in param.names}
    replicated = []
    for key, value in state_dict.items():
        if key in sharded_keys or key not in own:
            continue
        target = own[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
            )
        replicated.append((target, value))
    return index.states, fulls, replicated
