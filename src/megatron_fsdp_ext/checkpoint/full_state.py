"""Full (unsharded) state dicts that load into the plain, unwrapped nn.Module."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import backends
from ..core.agree import Agreement, digest, gather_objects, rank_world
from ..core.param_index import iter_states
from ..core.param_index import ParamIndex
from ..core.shard_changes import set_full_value
from ..core.state_dict import apply_state_dict_writes_of, local_state_dict
from ..core.states import ParamInit


def _param_index(module: nn.Module, loading: bool = False) -> ParamIndex:
    return ParamIndex(module, "full state dict", "call it between training steps or reshard() first",
                      loading=loading)


def full_state_dict(module: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict:
    """Gather every sharded parameter in full precision. Collective: call on all ranks.

    Returns the full state dict (same keys as the unwrapped module's) on global rank 0
    (also for a model sharded over a subgroup), or on every rank with rank0_only=False;
    other ranks get {}.
    """
    index = _param_index(module)
    # Writes into values an earlier state_dict() handed out are the parameters' values
    # (as they are on a plain module) before they are gathered; the values stay watched.
    apply_state_dict_writes_of(index.states, "full_state_dict()", may_change=lambda state: False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = (not rank0_only) or rank == 0
    with local_state_dict():  # sharded entries are replaced by the gathered values below
        sd = module.state_dict()
    for state in index.states:
        full = state.unit.gather_full_params()
        if state.tp is not None:  # the TP shards joined (a collective over tp)
            full = [state.tp.full_of_local(i, t).full_tensor() if i in state.tp.specs else t
                    for i, t in enumerate(full)]
        for p, t in zip(state.sharded_params, full):
            for key in index.names_of(p):
                if keep:
                    sd[key] = t.detach().cpu() if cpu_offload else t.detach().clone()
    if not keep:
        return {}
    if cpu_offload:
        sd = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    return sd


def agree_on_keys(module: nn.Module, state_dict: dict) -> Agreement:
    """The agreement around a load's local checks (its block): every rank that shares a
    unit's process group must pass the same keys (so that all issue the same all-gathers)
    and must have passed the local checks. One small collective per process group
    (usually one; none without units or torch.distributed) sends the digest of the keys
    `state_dict` holds when the block ends (the block may fill it); different keys
    outrank a failure; every rank raises alike."""
    groups = []
    if dist.is_available() and dist.is_initialized():
        for state in iter_states(module):
            if state.unit is not None and state.process_group is not None and \
                    all(g is not state.process_group for g in groups):
                groups.append(state.process_group)

    def same_keys(digests: dict, group) -> None:
        if len(set(digests.values())) > 1:
            sets = {r: set(k) for r, k in gather_objects(sorted(state_dict), group).items()}  # only on this error path
            first = min(k for k in set().union(*sets.values()) if not all(k in s for s in sets.values()))
            have = [r for r, s in sets.items() if first in s]
            lack = [r for r, s in sets.items() if first not in s]
            raise ValueError(
                f"load_full_state_dict: the ranks passed different keys: '{first}' is in the state dict of "
                f"rank(s) {have} but not of rank(s) {lack}; every rank must pass the same keys (nothing was loaded)"
            )

    return Agreement("load_full_state_dict", group=groups, share=lambda: digest(sorted(state_dict)), check=same_keys,
                     tail="; nothing was loaded")


def load_full_state_dict(module: nn.Module, state_dict: Optional[dict], *, strict: bool = True,
                         broadcast_from_rank0: bool = False) -> None:
    """Load a full (unsharded) state dict, as saved from the plain module or by
    full_state_dict(), into a sharded module. Collective: call on all ranks.

    Every rank passes the full dict, with the same keys (an error on every rank
    otherwise, naming the first key that differs); it may stay on the CPU: each rank
    copies only its slice of every parameter to the device. With
    broadcast_from_rank0=True only global rank 0 passes the dict (the others pass None
    or {}) and it is streamed to them one tensor at a time, so no other rank ever holds
    it whole (every rank must hold the same units). Everything is checked before
    anything is loaded; with strict=False, parameters absent from the dict keep their
    values. A model built on the meta device (deferred init) is materialized by the load:
    every one of its parameters, and meta buffers, must then be in the dict."""
    rank = rank_world()[0]
    if broadcast_from_rank0:
        backends.check_moves_data("load_full_state_dict(broadcast_from_rank0=True)", dist.group.WORLD)
        state_dict = _announce(module, state_dict if rank == 0 else None)
    elif state_dict is None:
        raise TypeError("load_full_state_dict: state_dict is None; pass the full state dict on every rank "
                        "(or only on rank 0 with broadcast_from_rank0=True)")
    # Streamed: the other ranks hold meta placeholders; rank 0 checks the values.
    with agree_on_keys(module, state_dict):
        states, values, replicated = plan_full_load(module, state_dict, strict,
                                                    placeholders=broadcast_from_rank0 and rank != 0)
    # Every rank of a unit's group loads the same units in the same order (the keys agree),
    # one parameter at a time: at most one full parameter is on the device at once (when
    # streamed), and a parameter absent from the dict (strict=False) keeps its shard.
    for state, unit_values in zip(states, values):
        for i, value in enumerate(unit_values):
            if value is not None:
                full = _fetch(value, state.unit.device, state.unit.orig_dtype, broadcast_from_rank0)
                set_full_value(state, i, full)  # copies this rank's slice
                del full
        state.mark_loaded()  # a deferred unit is loaded whole (checked in the plan)
    with torch.no_grad():
        for key, target, value in replicated:
            device = target.device if not target.is_meta else states[0].unit.device
            v = _fetch(value, device, target.dtype, broadcast_from_rank0)
            if target.is_meta:
                replace_meta(module, key, v.to(device=device, dtype=target.dtype))
            else:
                target.copy_(v)


def _announce(module: nn.Module, state_dict: Optional[dict]) -> dict:
    """On every rank, rank 0's state dict as meta tensors of the same shapes and dtypes
    (other values as they are); rank 0 keeps its own dict. One broadcast of metadata."""
    import torch.distributed as dist

    rank = rank_world()[0]
    meta = None
    if rank == 0:
        if not isinstance(state_dict, dict):
            meta = TypeError(f"load_full_state_dict(broadcast_from_rank0=True): rank 0 must pass the full state "
                             f"dict, got {type(state_dict).__name__}")
        else:
            meta = [(k, ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
                    for k, v in state_dict.items()]
    box = [meta]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    if rank == 0:
        return state_dict
    return {k: torch.empty(info[1], dtype=info[2], device="meta") if info[0] == "tensor" else info[1]
            for k, info in box[0]}


def _fetch(value, device: torch.device, dtype: torch.dtype, broadcast: bool):
    """`value` as a tensor a unit (or a replicated target) can copy from: as given (each
    rank copies its slice, converting device and dtype) or, when streamed from rank 0,
    received in full on `device`."""
    if not isinstance(value, torch.Tensor):
        return value
    if not broadcast:
        return value.detach()
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return value.detach()
    if dist.get_rank() == 0:
        t = value.detach().to(device=device, dtype=dtype).contiguous()
    else:
        t = torch.empty(value.shape, dtype=dtype, device=device)
    dist.broadcast(t, src=0)
    return t


def replace_meta(module: nn.Module, key: str, value: torch.Tensor) -> None:
    """Put a loaded value where a meta buffer (or meta parameter outside any unit) was."""
    owner_path, _, name = key.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if name in owner._buffers:
        owner._buffers[name] = value.clone()  # never aliases the caller's state dict
    else:
        old = owner._parameters[name]
        owner._parameters[name] = nn.Parameter(value.clone(), requires_grad=old.requires_grad)


def _check_value(key: str, value, placeholders: bool) -> None:
    """A value to load must be a tensor with data (a meta tensor holds none), unless the
    dict holds placeholders (shapes only: streamed values, safetensors)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"load_full_state_dict: '{key}' is a {type(value).__name__}, not a tensor; nothing was loaded")
    if value.is_meta and not placeholders:
        raise ValueError(f"load_full_state_dict: '{key}' is a meta tensor, which holds no values (a model built on "
                         "the meta device and never materialized?); nothing was loaded")


def plan_full_load(module: nn.Module, state_dict: dict, strict: bool, placeholders: bool = False):
    """The local checks, no collective: returns the units, each one's values (None where
    the dict lacks a parameter) and the replicated (key, target, value) triples. Every
    value is checked here, before anything is written."""
    index = _param_index(module, loading=True)
    for state in index.states:
        state.reshard()  # an early all-gather (start_param_sync) would now be stale
    with local_state_dict():
        try:
            own = module.state_dict()  # the replicated entries below are copied into these
        except Exception as e:
            # The model's own state-dict hooks (torchtitan's fused-qkv split) see this
            # rank's 1-D pieces here, and may also rename keys away from parameter names.
            raise RuntimeError(
                f"load_full_state_dict: {type(module).__name__}.state_dict() failed on this rank's pieces "
                f"({type(e).__name__}: {e}); a model whose state-dict hooks reshape or rename parameters loads "
                "full values through its own load_state_dict: torch.distributed.checkpoint.state_dict."
                "set_model_state_dict(model, values, options=StateDictOptions(full_state_dict=True)); nothing "
                "was loaded") from e
    expected = set(own)
    # A tied parameter is loaded through any of its names (Hugging Face files keep one).
    covered = {n for param in index.params.values() if any(k in state_dict for k in param.names) for n in param.names}
    missing = sorted(expected - set(state_dict) - covered)
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise KeyError(
            "load_full_state_dict: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected keys {unexpected}" if unexpected else "")
        )
    values = []
    for state in index.states:
        unit_values = []
        for p, u, name in zip(state.sharded_params, state.unsharded_params, state.names):
            keys = [k for k in index.names_of(p) if k in state_dict]
            if not keys:
                key = (index.names_of(p) or [name])[0]
                if state.param_init is ParamInit.DEFERRED:
                    raise KeyError(f"load_full_state_dict: parameter '{key}' was built on the meta device and is not "
                                   "in the state dict, so it would have no value; load every parameter or call "
                                   "materialize(model) first")
                if strict and index.names_of(p):  # one of a unit around `module`, outside it, has no key
                    raise KeyError(f"load_full_state_dict: missing key for parameter '{key}'")
                unit_values.append(None)
                continue
            value = state_dict[keys[0]]
            _check_value(keys[0], value, placeholders)
            if tuple(value.shape) != tuple(u.shape):
                raise ValueError(
                    f"load_full_state_dict: '{keys[0]}' has shape {tuple(value.shape)}, "
                    f"expected {tuple(u.shape)}"
                )
            unit_values.append(value)
        values.append(unit_values)
    # Everything else (buffers, ignored/unsharded parameters) is replicated: copied.
    sharded_keys = {k for param in index.params.values() for k in param.names}
    replicated = []
    for key, value in state_dict.items():
        if key in sharded_keys or key not in own:
            continue
        target = own[key]
        if isinstance(target, torch.Tensor):
            _check_value(key, value, placeholders)
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(
                f"load_full_state_dict: '{key}' has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
            )
        replicated.append((key, target, value))
    loaded = {key for key, _, _ in replicated}
    left = [k for k, t in own.items() if k not in sharded_keys and k not in loaded and t.is_meta]
    left += [n for n, b in module.named_buffers() if b.is_meta and n not in own]  # non-persistent
    if left:
        raise KeyError(f"load_full_state_dict: {left[:4]} {'is' if len(left) == 1 else 'are'} on the meta device "
                       "and not in the state dict (non-persistent buffers never are); call materialize(model) "
                       "first, which initializes them, then load")
    if any(t.is_meta for _, t, _ in replicated) and not index.states:
        raise ValueError("load_full_state_dict: meta tensors but no fully_shard unit to take the device from")
    return index.states, values, replicated
