"""Reading checkpoints of the flat format (format 1), which save_checkpoint wrote before it
saved torch's state dicts: they still load, at any world size and sharding strategy.

Format 1 stores every parameter of a fully_shard unit under its module name as one 1-D
tensor of its full numel, each rank's contiguous range of it a chunk; optimizer state
shaped like a shard likewise; scalar state and hyper-parameters replicated. Keys:

    model.<name>                  parameters (flattened) and buffers; extra state as the
                                  bytes of a torch.save that loads weights-only
    meta.param_shapes             the parameters' full shapes (checked on load), JSON
    optim.state.<name>.<key>      per-parameter optimizer state
    optim.param_groups            hyper-parameters, parameters listed by name, JSON
    optim.class                   the optimizer's class, JSON

The ranges come from the unit's FlatLayout, so every rank reads exactly its own pieces
(no collective). Loading runs nothing from the files: the metadata entries are JSON, or
pickles of builtin values only (an older version's), and extra state loads weights-only.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from ..core.agree import Agreement, failures, listing
from ..core.dtensor_face import local_shape
from .files import CheckpointError, no_manifest_message
from .reader import (SafeFileSystemReader, SafeLoadPlanner, decode_json, decode_legacy_pickle,
                                decode_object, encode_object)
from ..core.param_index import ParamIndex, iter_states
from ..core.state_dict import local_state_dict

FORMAT_KEY = "meta.param_shapes"  # written by format 1 only
_FLAT_ONLY_KEYS = (FORMAT_KEY, "optim.param_groups", "optim.class")


def is_flat_format(metadata, module: nn.Module) -> bool:
    """Whether a checkpoint's DCP metadata (state_dict_metadata) is of format 1: it has
    one of the entries only format 1 writes, or, naming no format, it stores a parameter
    of two or more dims as one flat tensor of its numel."""
    if any(k in metadata for k in _FLAT_ONLY_KEYS):
        return True
    if "meta.format" in metadata:
        return False
    for info in sharded_param_ranges(module, loading=True)[1].values():
        for name in info.names:
            stored = getattr(metadata.get(f"model.{name}"), "size", None)
            if stored is not None and len(info.full_shape) >= 2 and list(stored) == [info.full_numel]:
                return True
    return False


@contextlib.contextmanager
def quiet():
    """DCP warns on every ShardedTensor that the type is deprecated in favour of DTensor;
    DTensor cannot describe our uneven, layout-given ranges, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def _sharded_tensor(local: torch.Tensor, full_numel: int, ranges: List[Tuple[int, int, int]]):
    """A 1-D ShardedTensor of `full_numel` elements; `ranges` lists (rank, offset, numel)
    of every rank's piece, this rank's piece being `local`."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = "cpu" if local.device.type == "cpu" else f"cuda:{local.device.index}"
    rank = dist.get_rank()
    metas, local_shards = [], []
    for r, offset, numel in ranges:
        meta = ShardMetadata(shard_offsets=[offset], shard_sizes=[numel], placement=f"rank:{r}/{device}")
        metas.append(meta)
        if r == rank:
            local_shards.append(Shard(tensor=local, metadata=meta))
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    global_meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([full_numel]), tensor_properties=props)
    with warnings.catch_warnings():  # ShardedTensor is DCP's type for arbitrary chunks
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, global_meta)


class ParamRanges:
    """Where one sharded parameter's piece sits in the full (flattened) parameter."""

    def __init__(self, state, index: int, names: List[str]):
        unit = state.unit
        self.name = names[0]
        self.names = names  # tied parameters have several
        self.param = state.unit.sharded_param(index)
        spec = unit.param_spec(index)
        self.full_shape = spec.shape
        self.full_numel = spec.numel
        self.replicated = unit.strategy.replicated
        group = state.process_group
        # (global rank, offset, numel) of every non-empty piece in this rank's replica; the
        # other replicas describe the same offsets with their own ranks.
        self.ranges = []
        if not self.replicated:
            for r in range(unit.world_size):
                piece = unit.layout.shard_slice(index, r)
                if piece.numel > 0:
                    self.ranges.append((dist.get_global_rank(group, r), piece.param_offset, piece.numel))

    def wrap(self, local: torch.Tensor):
        """What DCP sees for `local` (the param or a state tensor shaped like it)."""
        if self.replicated or not self.ranges:
            return local  # every rank holds all of it (or it is empty): DCP writes it once
        return _sharded_tensor(local, self.full_numel, self.ranges)


def check_covers_world(states) -> None:
    """Units of different data-parallel groups (expert parallelism) would write different
    values under the same keys; DCP keeps one. HSDP replicas hold the same values, so
    keeping one of them is right, and so do the tp ranks of a tensor-parallel model for its
    parameters that are not DTensors (TP's replicate them); its DTensors name their tp
    ranks' parts. Both checkpoint formats need this."""
    states = list(states)
    world = dist.get_world_size()
    tp_size = max((s.tp.tp_size for s in states if getattr(s, "tp", None) is not None), default=1)
    for state in states:
        unit = state.unit
        if unit is None:
            continue
        # A unit of DTensors covers its own outer mesh (TP, or MoE's expert-parallel mesh
        # under the expert data-parallel one); a plain unit of a tensor-parallel job is
        # the same on its tp ranks; a plain unit of an MoE job may span the whole job.
        own = state.tp.tp_size if getattr(state, "tp", None) is not None else 1
        covered = unit.world_size * unit.replicate_size * own
        if covered != world and (own > 1 or covered * tp_size != world):
            tp = f" and tensor-parallel over {max(own, tp_size)}" if max(own, tp_size) > 1 else ""
            raise NotImplementedError(
                f"sharded checkpoint: {state} is sharded over {unit.world_size} of {world} ranks and replicated "
                f"{unit.replicate_size}x{tp}; sharded checkpoints need units whose shards and replicas cover the "
                "whole job (use full_state_dict for other layouts)")


def sharded_param_ranges(module: nn.Module, loading: bool = False) -> Tuple[ParamIndex, Dict[int, ParamRanges]]:
    index = ParamIndex(module, "sharded checkpoint", "save or load between training steps, or reshard() first",
                       loading=loading)
    check_covers_world(index.states)
    tp = next((s for s in index.states if getattr(s, "tp", None) is not None), None)
    if tp is not None:  # the flat format was never written for tensor-parallel models
        raise NotImplementedError(f"sharded checkpoint of the flat format: {tp} holds tensor-parallel (DTensor) "
                                  "parameters, which that format cannot place; it loads into models without TP")
    return index, {pid: ParamRanges(*param) for pid, param in index.params.items()}


def _by_name(infos: Dict[int, ParamRanges]) -> Dict[str, ParamRanges]:
    return {n: info for info in infos.values() for n in info.names}


def model_entries(module: nn.Module, infos: Dict[int, ParamRanges], staged: Optional[list] = None) -> dict:
    """The model's entries. With `staged` (loading), tensors are fresh copies that the
    load writes into, listed as (module tensor, copy) in `staged` for _commit."""
    entries = {}
    by_name = _by_name(infos)
    with local_state_dict():  # this rank's 1-D shards: wrapped below with their ranges
        own = module.state_dict(keep_vars=True)

    def target(value: torch.Tensor) -> torch.Tensor:
        value = value.detach()
        if staged is None:
            return value
        copy = torch.empty_like(value)
        staged.append((value, copy))
        return copy

    for key, value in own.items():
        info = by_name.get(key)
        if info is not None:
            entries[f"model.{key}"] = info.wrap(target(value))
        elif _is_extra_state(key, value):
            # Opaque to us (dicts, tensors, bytes): one saved object, handed back to the
            # module's set_extra_state by load_state_dict. DCP would otherwise flatten a
            # dict into many keys or load a tensor into a temporary. What could not load
            # weights-only (arbitrary classes) is refused here, at save.
            entries[f"model.{key}"] = encode_object(value, f"sharded checkpoint: module state '{key}'")
        else:  # buffers and parameters of no unit: replicated
            entries[f"model.{key}"] = target(value)
    return entries


def _commit(staged: list) -> None:
    """The loaded copies into the module's tensors, once every rank read everything."""
    with torch.no_grad():
        for dest, copy in staged:
            dest.copy_(copy)


def _is_extra_state(key: str, value) -> bool:
    return key.endswith("_extra_state") or not isinstance(value, torch.Tensor)


def param_shapes(infos: Dict[int, ParamRanges]) -> Dict[str, tuple]:
    return {n: info.full_shape for n, info in _by_name(infos).items()}


def optimizer_param_names(optimizer: torch.optim.Optimizer, index: ParamIndex) -> List[List[str]]:
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if not index.names_of(p)]
        if missing:
            raise ValueError(
                "sharded checkpoint: the optimizer holds a parameter that is not in the module "
                f"(shape {tuple(missing[0].shape)}); build the optimizer from module.parameters()"
            )
        groups.append([index.names_of(p)[0] for p in g["params"]])
    return groups



SMALL_ENTRIES = ("meta.param_shapes", "optim.param_groups", "optim.class")


def _decode_small(value, key: str, path: str):
    """One of our metadata entries: JSON text, or a builtin-only pickle of an earlier version."""
    what = f"load_checkpoint({path}): '{key}'"
    return decode_legacy_pickle(value, what) if isinstance(value, (bytes, bytearray)) else decode_json(value, what)



def _fmt_shape(info: ParamRanges) -> str:
    return f"shape {info.full_shape} ({info.full_numel} elements)"




class _Plan:
    pass


def plan_load(path: str, target_dir: str, module: nn.Module, optimizer, meta, unverified: bool) -> _Plan:
    """What the metadata alone tells (no data read): the keys match, the targets to load into.
    `meta`: the checkpoint's state_dict_metadata; `unverified`: it has no manifest although
    verification was asked for (refused once the compatibility checks ran)."""
    plan = _Plan()
    plan.meta, plan.reader_path = meta, target_dir
    plan.meta_file = os.path.join(target_dir, ".metadata")  # what metadata-derived errors name
    plan.unverified = unverified
    index, infos = sharded_param_ranges(module, loading=True)
    plan.infos = infos
    plan.staged = []  # read into copies: a failed read leaves the module as it was
    plan.target = model_entries(module, infos, plan.staged)
    stored_model = {k for k in meta if k.startswith("model.")}
    try:
        check_keys("model", set(plan.target), stored_model, plan.meta_file)
    except KeyError as e:
        if plan.unverified:  # not ours at all: say what it is and how to load it
            raise CheckpointError(no_manifest_message(path, target_dir, True) + f" (Its keys differ too: {e.args[0]})")
        raise
    plan.objects = [k for k, v in plan.target.items() if isinstance(v, bytes)]
    for key in plan.objects:
        plan.target[key] = b""  # saved extra state: DCP fills it in, load_state_dict applies it
    # What metadata may make us allocate: no more than the data files hold.
    plan.data_bytes = sum(os.path.getsize(os.path.join(target_dir, n)) for n in os.listdir(target_dir)
                          if n.endswith(".distcp"))
    if optimizer is not None:
        plan.group_names = optimizer_param_names(optimizer, index)
    return plan


def _check_plan(plan: _Plan, small: dict, module: nn.Module, optimizer, path: str) -> None:
    meta, infos, target = plan.meta, plan.infos, plan.target
    if "meta.param_shapes" in small:
        saved_shapes = _decode_small(small["meta.param_shapes"], "meta.param_shapes", path)
        if not isinstance(saved_shapes, dict):
            raise CheckpointError(f"load_checkpoint({path}): 'meta.param_shapes' is not a mapping of shapes")
        for name, shape in param_shapes(infos).items():
            if name in saved_shapes and tuple(saved_shapes[name]) != shape:
                raise ValueError(f"load_checkpoint: 'model.{name}' has shape {tuple(saved_shapes[name])} in {path}, "
                                 f"the model's parameter has shape {shape}")
    by_name = _by_name(infos)
    for key, value in target.items():
        if key in plan.objects:
            continue
        size = list(getattr(meta[key], "size", []))
        info = by_name.get(key.removeprefix("model."))
        if info is not None:
            if size == list(info.full_shape) and len(size) != 1:
                raise ValueError(
                    f"load_checkpoint: '{key}' in {plan.meta_file} is stored in its full shape {tuple(size)}, as "
                    "torch's state-dict helpers and FSDP2 write it, not flattened as save_checkpoint writes it; load "
                    "such a checkpoint with torch.distributed.checkpoint: dcp.load({'model': get_model_state_dict(model), "
                    "...}) then set_model_state_dict / set_optimizer_state_dict"
                )
            if size != [info.full_numel]:
                raise ValueError(
                    f"load_checkpoint: '{key}' holds {size[0] if len(size) == 1 else size} elements in "
                    f"{plan.meta_file}, but the model's parameter has {_fmt_shape(info)}"
                )
        elif size != list(value.shape):
            raise ValueError(f"load_checkpoint: '{key}' has shape {tuple(size)} in {plan.meta_file}, "
                             f"the model's has {tuple(value.shape)}")
    if optimizer is not None:
        _plan_optimizer(plan, small, optimizer, path)
    unknown = sorted(k for k in meta if not (k.startswith(("model.", "optim.state.")) or k in SMALL_ENTRIES))
    if unknown and not plan.unverified:  # nothing is ignored: a renamed entry would drop its values silently
        raise KeyError(f"load_checkpoint({path}): {plan.meta_file} lists entries no save_checkpoint writes: "
                       f"{unknown[:5]}; the checkpoint is corrupted or not ours; nothing was loaded")
    if plan.unverified:
        raise CheckpointError(no_manifest_message(path, plan.reader_path, True))


def optimizer_state_kind(cls) -> str:
    """What an optimizer class's state means: its name, or the torch optimizer whose state
    and hyper-parameters it shares (`_mfsdp_state_kind`: optim.CPUAdamW is "AdamW"), so
    that a checkpoint moves between the two."""
    return getattr(cls, "_mfsdp_state_kind", cls.__qualname__)


def check_optimizer_class(saved_class: Optional[dict], saved_groups: list, optimizer, path: str) -> None:
    mine = type(optimizer)
    if saved_class is not None:
        if saved_class.get("state_kind", saved_class.get("name")) != optimizer_state_kind(mine):
            raise ValueError(
                f"load_checkpoint({path}): the checkpoint was saved from {saved_class.get('name')} "
                f"({saved_class.get('module')}); this optimizer is {mine.__qualname__} ({mine.__module__}): its state "
                f"and hyper-parameters do not apply. Build a {saved_class.get('name')} to resume, or load the model "
                "alone (load_checkpoint(path, model)); nothing was loaded")
        return
    # Older checkpoints do not name the class: hyper-parameters this optimizer does not
    # have betray another one (SGD's momentum in AdamW, AdamW's betas in SGD).
    saved_keys = {k for g in saved_groups for k in g if k != "params"}
    my_keys = {k for g in optimizer.param_groups for k in g if k != "params"} | set(optimizer.defaults)
    foreign = sorted(saved_keys - my_keys)
    if foreign:
        raise ValueError(
            f"load_checkpoint({path}): the checkpoint's optimizer has hyper-parameters {foreign}, which this "
            f"{mine.__qualname__} does not have: it was saved from another optimizer class (this checkpoint does "
            f"not name it). Build the same optimizer to resume, or load the model alone; nothing was loaded")


def _plan_optimizer(plan: _Plan, small: dict, optimizer, path: str) -> None:
    meta, target, group_names = plan.meta, plan.target, plan.group_names
    if "optim.param_groups" not in meta:
        raise KeyError(f"load_checkpoint: {plan.meta_file} lists no optimizer state ('optim.param_groups' is missing); "
                       "load without an optimizer or pick a checkpoint saved with one")
    saved_groups = _decode_small(small["optim.param_groups"], "optim.param_groups", path)
    saved_class = _decode_small(small["optim.class"], "optim.class", path) if "optim.class" in small else None
    if not (isinstance(saved_groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                   for g in saved_groups)):
        raise CheckpointError(f"load_checkpoint({path}): 'optim.param_groups' is not a list of parameter groups")
    if saved_class is not None and not isinstance(saved_class, dict):
        raise CheckpointError(f"load_checkpoint({path}): 'optim.class' does not name a class")
    check_optimizer_class(saved_class, saved_groups, optimizer, path)
    check_groups(saved_groups, group_names, path)
    known = {n for names in group_names for n in names}
    prefix = "optim.state."
    stored_states: Dict[str, Dict[str, object]] = {}
    for key, m in meta.items():
        if not key.startswith(prefix):
            continue
        name, state_key = split_state_key(key[len(prefix):], known)
        if name is None:
            raise KeyError(f"load_checkpoint: optimizer state '{key}' in {plan.meta_file} belongs to no parameter of "
                           "this optimizer")
        stored_states.setdefault(name, {})[state_key] = (key, m)
    params_by_name = {n: p for g, names in zip(optimizer.param_groups, group_names) for p, n in zip(g["params"], names)}
    info_by_name = _by_name(plan.infos)
    local: Dict[str, object] = {}  # what each state key lands in on this rank
    for name, entries in stored_states.items():
        p, info = params_by_name[name], info_by_name.get(name)
        for state_key, (key, m) in entries.items():
            if not hasattr(m, "size"):
                target[key] = None  # a non-tensor value: DCP fills it in
                continue
            size, dtype = list(m.size), m.properties.dtype
            if any(s < 0 for s in size) or math.prod(size) * dtype.itemsize > plan.data_bytes:
                raise CheckpointError(f"load_checkpoint({path}): '{key}' claims shape {tuple(size)} in "
                                      f"{plan.meta_file}, more than the checkpoint's data files hold ({plan.data_bytes} bytes)")
            if info is not None and len(size) == 1 and size[0] == info.full_numel:
                local[key] = torch.empty(local_shape(p), dtype=dtype, device=p.device)
                target[key] = info.wrap(local[key])
            elif info is not None and len(size) == 1 and size[0] > 1:
                raise ValueError(f"load_checkpoint: '{key}' holds {size[0]} elements in {plan.meta_file}, but the "
                                 f"parameter '{name}' has {_fmt_shape(info)}")
            else:  # scalar state (Adam's step) or state of a parameter outside any unit
                local[key] = target[key] = torch.empty(size, dtype=dtype, device=p.device)
    plan.stored_states, plan.local, plan.saved_groups = stored_states, local, saved_groups


def _apply_optimizer(plan: _Plan, small: dict, optimizer) -> None:
    target, group_names = plan.target, plan.group_names
    index = {}
    for names in group_names:
        for n in names:
            index[n] = len(index)
    osd_state = {}
    for name, entries in plan.stored_states.items():
        osd_state[index[name]] = {state_key: plan.local.get(key, target[key]) for state_key, (key, _) in entries.items()}
    osd_groups = []
    for saved, names in zip(plan.saved_groups, group_names):
        g = {k: v for k, v in saved.items() if k != "params"}
        g["params"] = [index[n] for n in names]
        osd_groups.append(g)
    with local_state_dict():  # the entries are already this rank's pieces
        optimizer.load_state_dict({"state": osd_state, "param_groups": osd_groups})


def read_into(target: dict, path: str, directory: str, metadata=None, verification=None, threads: int = 1) -> None:
    """dcp.load, whose failures (gathered from every rank into a CheckpointException on
    every rank) become a CheckpointError naming the failing ranks. metadata,
    verification, threads: SafeFileSystemReader's."""
    try:
        with quiet():
            reader = SafeFileSystemReader(directory, metadata=metadata, verification=verification, threads=threads)
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        failed = failures(e, 0)
        raise CheckpointError(f"load_checkpoint({path}): reading failed on rank(s) {sorted(failed)}: "
                              f"{listing(failed)}") from e


def _decode_extra_state(data, key: str, path: str):
    """Extra state saved by this version (a weights-only torch.save), or by an earlier one
    (a pickle: loaded only when it names no class)."""
    what = f"load_checkpoint({path}): '{key}'"
    if isinstance(data, (bytes, bytearray)) and bytes(data[:2]) == b"PK":  # torch.save's zip format
        return decode_object(data, what)
    return decode_legacy_pickle(data, what)


def split_state_key(rest: str, known: set):
    """'blocks.0.w.weight.exp_avg' -> ('blocks.0.w.weight', 'exp_avg'). State keys may
    contain dots themselves ('ema.decay'), so the longest known parameter name that
    prefixes `rest` wins."""
    parts = rest.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        if name in known:
            return name, ".".join(parts[cut:])
    return None, None


def check_groups(saved_groups, group_names, path: str) -> None:
    saved = [s["params"] for s in saved_groups]
    for i, (old, new) in enumerate(zip(saved, group_names)):
        extra, missing = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        if extra:
            raise KeyError(f"load_checkpoint({path}): optimizer group {i} in the checkpoint has parameter "
                           f"'{extra[0]}', which is not in this optimizer's group {i}")
        if missing:
            raise KeyError(f"load_checkpoint({path}): this optimizer's group {i} has parameter '{missing[0]}', "
                           f"which is not in the checkpoint's group {i}")
    if len(saved) != len(group_names):
        raise ValueError(f"load_checkpoint({path}): the checkpoint's optimizer has {len(saved)} parameter groups, "
                         f"this optimizer has {len(group_names)}; build the optimizer the same way")


def check_keys(what: str, expected: set, stored: set, path: str) -> None:
    missing, extra = sorted(expected - stored), sorted(stored - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"in the checkpoint but not in the {what}: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise KeyError(f"load_checkpoint({path}): {what} keys differ; " + "; ".join(parts))


def finish_load(plan: _Plan, path: str, module: nn.Module, optimizer, verification, threads: int = 1) -> None:
    """Check the plan against the small entries, read, then apply; each stage agreed on
    every rank, so that a failure anywhere leaves every rank's module and optimizer as
    they were (nothing is half-loaded). `verification` (files.py, Verification)
    checks the bytes as they are read; what it found is agreed on before anything is
    applied, and outranks any other failure."""
    what = f"load_checkpoint({path})"
    with verification.stage():
        small = {k: b"" for k in SMALL_ENTRIES
                 if k in plan.meta and (optimizer is not None or k == FORMAT_KEY)}
        if small:
            read_into(small, path, plan.reader_path, verification=verification)
        _check_plan(plan, small, module, optimizer, path)
    with verification.read_stage():
        read_into(plan.target, path, plan.reader_path, verification=verification, threads=threads)
        objects = {k[len("model."):]: _decode_extra_state(plan.target[k], k, path) for k in plan.objects}
    with Agreement(what, error=CheckpointError):
        _commit(plan.staged)
        if objects:
            with local_state_dict():
                module.load_state_dict(objects, strict=False)
        for state in iter_states(module):  # every parameter was in the checkpoint (keys match exactly)
            state.mark_loaded()
        if optimizer is not None:
            _apply_optimizer(plan, small, optimizer)
