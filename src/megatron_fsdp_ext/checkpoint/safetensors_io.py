"""Loading safetensors files (the format Hugging Face checkpoints ship in) into a sharded
model, each rank reading only the rows that hold its slice of each parameter: no rank
reads or allocates a whole parameter, so a model built on the meta device is
materialized from the files with memory for its shards only."""
from __future__ import annotations

import glob
import os
from typing import Dict, List

import torch
import torch.nn as nn

from ..core.agree import Agreement, gather_objects
from .full_state import agree_on_keys, plan_full_load, replace_meta
from .files import check_same_path
from ..core.shard_changes import set_full_value

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _files(path: str) -> List[str]:
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"load_safetensors: no *.safetensors file in {path}")
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_safetensors: {path} is neither a .safetensors file nor a directory of them")
    return [path]


def _rows_for(handle, key: str, shape: tuple, start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the flattened tensor `key`, reading only the
    dim-0 rows that hold them."""
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:start + numel]
    row = 1
    for d in shape[1:]:
        row *= d
    first, last = start // row, -(-(start + numel) // row)
    rows = handle.get_slice(key)[first:last].reshape(-1)
    return rows[start - first * row: start - first * row + numel]


def load_safetensors(module: nn.Module, path, *, strict: bool = True) -> None:
    """Load a .safetensors file, or a directory of them, into a sharded module.
    Collective: call on all ranks, with the same path. Keys are the module's state_dict
    keys (a tied parameter may appear under any one of its names); each rank reads only
    its slice of every parameter, and whole buffers. Checks (keys, shapes) come first and
    are agreed across ranks; with strict=False parameters absent from the files keep
    their values. A model built on the meta device is materialized by the load."""
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - transformers brings it
        raise ImportError("load_safetensors needs the safetensors package: pip install safetensors") from e
    check_same_path("load_safetensors", gather_objects(os.path.abspath(os.fspath(path))))
    handles: Dict[str, object] = {}
    where: Dict[str, str] = {}
    placeholders: Dict[str, torch.Tensor] = {}
    with agree_on_keys(module, placeholders):  # the keys of the files, as far as they were read
        for f in _files(path):
            try:
                handles[f] = h = safe_open(f, framework="pt", device="cpu")
            except Exception as e:  # truncated or not a safetensors file: say which
                raise ValueError(f"load_safetensors: {f} is not a readable safetensors file ({e})") from e
            for key in h.keys():
                if key in where:
                    raise ValueError(f"load_safetensors: '{key}' is in both {where[key]} and {f}")
                where[key] = f
                info = h.get_slice(key)
                dtype = _DTYPES.get(info.get_dtype())
                if dtype is None:
                    raise ValueError(f"load_safetensors: '{key}' in {f} has dtype {info.get_dtype()}, not supported")
                placeholders[key] = torch.empty(tuple(info.get_shape()), dtype=dtype, device="meta")
        states, values, replicated = plan_full_load(module, placeholders, strict, placeholders=True)
    key_of = {id(v): k for k, v in placeholders.items()}
    # Read everything this rank needs first (its slices, the replicated values), agreed
    # across ranks: a file that fails to read on any rank leaves every rank's module as
    # it was.
    slices_read, whole_read = [], []
    with Agreement("load_safetensors", tail="; nothing was loaded"):
        for state, unit_values in zip(states, values):
            specs = state.unit.param_specs
            for i, value in enumerate(unit_values):
                piece = specs[i].slice
                if value is None or piece.numel == 0:
                    continue
                key = key_of[id(value)]
                if state.tp is not None and i in state.tp.specs:  # read whole: cut to the TP shard, then the slice
                    slices_read.append((state, i, _read(where[key], lambda: handles[where[key]].get_tensor(key))))
                    continue
                slices_read.append((state, i, _read(where[key], lambda: _rows_for(
                    handles[where[key]], key, tuple(value.shape), piece.param_offset, piece.numel))))
        for key, target, value in replicated:
            whole_read.append((key, target, _read(where[key], lambda: handles[where[key]].get_tensor(key))))
    with torch.no_grad():
        for state, i, local in slices_read:
            set_full_value(state, i, local.to(device=state.unit.device, dtype=state.unit.orig_dtype))
        for state in states:
            state.mark_loaded()  # a deferred unit is loaded whole (checked in the plan)
        for key, target, whole in whole_read:
            if target.is_meta:
                replace_meta(module, key, whole.to(device=states[0].unit.device, dtype=target.dtype))
            else:
                target.copy_(whole)


def _read(path: str, read):
    try:
        return read()
    except Exception as e:
        raise ValueError(f"load_safetensors: reading {path} failed ({e})") from e
