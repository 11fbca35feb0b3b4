"""Sharded checkpoints through torch.distributed.checkpoint (DCP), reshardable across
world sizes and sharding strategies.

Every parameter of a fully_shard unit is stored under its module name as one 1-D
tensor of its full numel; each rank writes only its contiguous range of it. The
ranges come from the unit's FlatLayout (every rank can compute every rank's slice), so
saving needs no collective per parameter. Loading reads whatever ranges the current
layout needs, whatever layout wrote them: world 2 -> 4 -> 1, ZeRO-3 -> no_shard -> ZeRO-3.
Optimizer state tensors shaped like a shard are stored the same way; scalar state
(Adam's step) and hyper-parameters are replicated. Keys:

    model.<name>                  parameters (flattened) and buffers; extra state as the
                                  bytes of a torch.save that loads weights-only
    meta.param_shapes             the parameters' full shapes (checked on load), JSON
    optim.state.<name>.<key>      per-parameter optimizer state
    optim.param_groups            hyper-parameters, parameters listed by name, JSON
    optim.class                   the optimizer's class (a checkpoint of SGD is no AdamW's), JSON

Loading runs nothing from the files (checkpoint_reader): DCP's .metadata is read through
a restricted unpickler, values stored as bytes load weights-only, our metadata is JSON.
Checkpoints whose metadata an earlier version pickled still load when those pickles hold
only builtin values; one naming a class is refused with how to convert it.

save_checkpoint publishes a checkpoint only once it is whole: all ranks agree on the
directory, write into a fresh sibling directory, agree that every write succeeded, hash
what they wrote, and rank 0 writes the manifest (mfsdp_manifest.json: every file with its
sha256 and size), then swaps the directory into place with renames. load_checkpoint
refuses a directory without the manifest and checks every file's hash (each file hashed
once, by one rank) before it loads anything. Every failure is raised on every rank. The
file handling (manifest, hashes, renames, rank agreement) lives in checkpoint_files.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import uuid
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from . import backends
from .checkpoint_reader import (SafeFileSystemReader, SafeLoadPlanner, decode_json, decode_legacy_pickle,
                                decode_object, encode_json, encode_object)
from .agree import Agreement, describe, failures, gather_objects, listing, rank_world
from .checkpoint_files import (  # CheckpointError and MANIFEST_NAME are also this module's API
    MANIFEST_NAME, WRITER, CheckpointError, barrier, check_covered, check_replaceable, check_same_path, file_digest,
    from_rank0, moved_aside, no_manifest_message, publish, read_manifest, sibling, verify_share,
)
from .param_index import iter_states
from .param_index import ParamIndex
from .state_dict import local_state_dict


@contextlib.contextmanager
def _quiet():
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


class _ParamInfo:
    """Where one sharded parameter's piece sits in the full (flattened) parameter."""

    def __init__(self, state, index: int, names: List[str]):
        unit = state.unit
        self.name = names[0]
        self.names = names  # tied parameters have several
        self.param = state.sharded_params[index]
        spec = unit.param_spec(index)
        self.full_shape = spec.shape
        self.full_numel = spec.numel
        self.replicated = unit.strategy.replicated
        group = state.process_group
        if dist.get_world_size(group) * unit.replicate_size != dist.get_world_size():
            # Units of different data-parallel groups (tensor/expert parallelism) would
            # write different values under the same keys and offsets; DCP keeps one.
            # HSDP replicas are fine: they hold the same values, so keeping one is right.
            raise NotImplementedError(
                f"sharded checkpoint: {state} is sharded over {dist.get_world_size(group)} of "
                f"{dist.get_world_size()} ranks and replicated {unit.replicate_size}x; sharded checkpoints "
                "need units whose shards and replicas cover the whole job (use full_state_dict for other layouts)"
            )
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


def _sharded_params(module: nn.Module, loading: bool = False) -> Tuple[ParamIndex, Dict[int, _ParamInfo]]:
    index = ParamIndex(module, "sharded checkpoint", "save or load between training steps, or reshard() first",
                       loading=loading)
    return index, {pid: _ParamInfo(*param) for pid, param in index.params.items()}


def _by_name(infos: Dict[int, _ParamInfo]) -> Dict[str, _ParamInfo]:
    return {n: info for info in infos.values() for n in info.names}


def _model_entries(module: nn.Module, infos: Dict[int, _ParamInfo], staged: Optional[list] = None) -> dict:
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


def _param_shapes(infos: Dict[int, _ParamInfo]) -> Dict[str, tuple]:
    return {n: info.full_shape for n, info in _by_name(infos).items()}


def _optimizer_params(optimizer: torch.optim.Optimizer, index: ParamIndex) -> List[List[str]]:
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


def sharded_state_dict(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """The state dict to hand to torch.distributed.checkpoint.save (collective-free), for
    storage other than a filesystem directory. Such a checkpoint has no manifest: nothing
    verifies it is whole or intact (load_checkpoint(..., verify=False) reads one from a
    directory unverified)."""
    index, infos = _sharded_params(module)
    sd = _model_entries(module, infos)
    # Parameters are stored flattened: their full shapes travel beside them, so that a
    # load can tell a [4, 2] weight from a [2, 4] one.
    sd["meta.param_shapes"] = encode_json({n: list(s) for n, s in _param_shapes(infos).items()})
    if optimizer is None:
        return sd
    group_names = _optimizer_params(optimizer, index)
    groups_meta = []
    for g, names in zip(optimizer.param_groups, group_names):
        groups_meta.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        for p, name in zip(g["params"], names):
            info = infos.get(id(p))
            for key, value in optimizer.state.get(p, {}).items():
                entry = f"optim.state.{name}.{key}"
                if isinstance(value, torch.Tensor) and info is not None and value.shape == p.shape and value.dim() == 1:
                    sd[entry] = info.wrap(value)
                else:
                    sd[entry] = value
    # JSON text: DCP would otherwise flatten the list of dicts into many keys.
    for i, g in enumerate(groups_meta):
        for k, v in g.items():
            try:
                encode_json(v)
            except TypeError as e:
                raise TypeError(f"sharded checkpoint: optimizer param group {i} holds {k!r} = {v!r}: {e}; a "
                                "checkpoint stores hyper-parameters as numbers, strings, booleans, None, tuples, lists "
                                "and 0-d tensors") from None
    sd["optim.param_groups"] = encode_json(groups_meta)
    # Beside the hyper-parameters: load_checkpoint refuses another optimizer class.
    sd["optim.class"] = encode_json({"name": type(optimizer).__qualname__, "module": type(optimizer).__module__})
    return sd


_SMALL_ENTRIES = ("meta.param_shapes", "optim.param_groups", "optim.class")


def _decode_small(value, key: str, path: str):
    """One of our metadata entries: JSON text, or a builtin-only pickle of an earlier version."""
    what = f"load_checkpoint({path}): '{key}'"
    return decode_legacy_pickle(value, what) if isinstance(value, (bytes, bytearray)) else decode_json(value, what)


# ----------------------------------------------------------------------------- save and load

def _refuse_without_data(what: str) -> None:
    if dist.is_available() and dist.is_initialized():
        backends.check_moves_data(what, dist.group.WORLD)


def save_checkpoint(path: str, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Save model (and optimizer) state to directory `path`, replacing the checkpoint
    there only once the new one is complete. Collective: call on all ranks, with the
    same path.

    The ranks write into a fresh sibling directory; when every write succeeded, each rank
    hashes its files, rank 0 writes the manifest (mfsdp_manifest.json: file -> sha256 and
    size) and renames the directory into place. A failure on any rank (a full disk, a
    crash in a write) raises CheckpointError on every rank naming the failing rank(s);
    the previous checkpoint at `path` is left as it was. Different paths on different
    ranks raise ValueError on every rank before anything is written. `path` must be new,
    or a directory holding only a checkpoint. For storage other than a filesystem, pass
    sharded_state_dict() to torch.distributed.checkpoint.save yourself (unverified)."""
    _refuse_without_data("save_checkpoint")
    rank, world = rank_world()
    target = os.path.abspath(os.fspath(path))
    what = f"save_checkpoint({path})"
    token = uuid.uuid4().hex[:16] if rank == 0 else None

    def same_path(shared: Dict[int, Tuple[str, Optional[str]]], _) -> None:  # outranks any failure
        check_same_path("save_checkpoint", {r: p for r, (p, _token) in shared.items()})

    with Agreement(what, error=CheckpointError, share=(target, token), check=same_path) as prepared:
        sd = sharded_state_dict(module, optimizer)
        if rank == 0:
            check_replaceable(target)
    token = prepared.shared[0][1]
    tmp = sibling(target, "tmp", token)

    def abort(stage: str, failed: Dict[int, str], cause: Optional[BaseException]):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()  # the temporary directory is gone on return, on every rank
        kept = (f"the previous checkpoint at {target} is unchanged" if os.path.isdir(target)
                else f"nothing was written to {target}")
        raise CheckpointError(f"{what}: {stage} failed on rank(s) {sorted(failed)} ({listing(failed)}); "
                              f"{kept}") from cause

    # 1. Write. DCP gathers a failed write into a CheckpointException on every rank.
    with Agreement(what, fail=functools.partial(abort, "writing the checkpoint")) as written:
        with _quiet():
            dcp.save(sd, checkpoint_id=tmp)
        if rank == 0:  # every rank's write has finished once dcp.save returns on rank 0
            written.share = sorted(n for n in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, n)))
    files = written.shared[0]

    # 2. Hash: each rank the files it wrote (rank 0 also the metadata).
    with Agreement(what, share={}, fail=functools.partial(abort, "hashing the written files")) as hashed:
        for name in files:
            m = WRITER.match(name)
            writer = int(m.group(1)) if m and int(m.group(1)) < world else 0
            if writer == rank:
                hashed.share[name] = file_digest(os.path.join(tmp, name))

    # 3. Publish (rank 0), then tell everyone how it went: this is also the final barrier.
    outcome = None
    if rank == 0:
        try:
            everything: Dict[str, Tuple[str, int]] = {}
            for digests in hashed.shared.values():
                everything.update(digests)
            publish(target, tmp, token, everything, world)
        except Exception as e:
            outcome = describe(e)
            shutil.rmtree(tmp, ignore_errors=True)
    outcome = from_rank0(outcome)
    if outcome is not None:
        kept = (f"the previous checkpoint at {target} is unchanged" if os.path.isdir(target)
                else f"nothing was written to {target}{moved_aside(target)}")
        raise CheckpointError(f"{what}: publishing the checkpoint failed on rank 0 ({outcome}); {kept}")


def _fmt_shape(info: _ParamInfo) -> str:
    return f"shape {info.full_shape} ({info.full_numel} elements)"



def load_checkpoint(path: str, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    verify: bool = True) -> None:
    """Load a checkpoint written by save_checkpoint, under any world size and sharding
    strategy, into `module` (and `optimizer`, whose state is replaced). Collective: call
    on all ranks, with the same path.

    Before anything is loaded: the ranks must agree on the path (ValueError otherwise);
    the directory must hold the manifest save_checkpoint writes last, and every file must
    match its sha256 there (each file is hashed by one rank; CheckpointError naming the
    file otherwise); keys must match exactly (a missing or extra key, or a shape mismatch,
    is an error naming the key); the optimizer must be of the class that was saved.
    Every error is raised on every rank. verify=False skips the manifest and hashes (for
    checkpoints written with dcp.save(sharded_state_dict(...)))."""
    _refuse_without_data("load_checkpoint")
    rank, world = rank_world()
    target = os.path.abspath(os.fspath(path))
    what = f"load_checkpoint({path})"
    check_same_path("load_checkpoint", gather_objects(target))

    # Local checks: integrity (this rank's share of the hashes: the corrupted files it
    # found), then what the metadata alone tells. Agreed in one collective; a corrupted
    # file outranks any other error.
    def refuse_corrupted(shared: Dict[int, List[str]], _) -> None:
        bad = [line for lines in shared.values() for line in lines]
        if bad:
            more = f"; and {len(bad) - 1} more: {bad[1:4]}" if len(bad) > 1 else ""
            raise CheckpointError(f"{what}: the checkpoint is corrupted (checked against {MANIFEST_NAME}); nothing "
                                  f"was loaded: {bad[0]}{more}")

    with Agreement(what, error=CheckpointError, share=[], check=refuse_corrupted) as checked:
        if not os.path.isdir(target):
            raise FileNotFoundError(f"{what}: no checkpoint directory at {target}{moved_aside(target)}")
        manifest = read_manifest(path, target) if verify else None
        if manifest is not None:
            checked.share = verify_share(target, manifest, rank, world)
        if not checked.share:
            plan = _plan(path, target, module, optimizer, manifest, verify)

    # Checks that read small objects (shapes, optimizer class and groups), agreed again:
    # nothing has been loaded into the module or the optimizer before this passes.
    with Agreement(what, error=CheckpointError):
        small = {k: b"" for k in _SMALL_ENTRIES
                 if k in plan.meta and (optimizer is not None or k == "meta.param_shapes")}
        if small:
            _load(small, path, plan.reader_path)
        _check_plan(plan, small, module, optimizer, path)

    # The read, into copies; its outcome is agreed, so that a failure on any rank leaves
    # every rank's module and optimizer as they were (nothing is half-loaded).
    with Agreement(what, error=CheckpointError):
        _load(plan.target, path, plan.reader_path)
        objects = {k[len("model."):]: _decode_extra_state(plan.target[k], k, path) for k in plan.objects}

    # Applied; its outcome is agreed too, so that no rank carries on alone.
    with Agreement(what, error=CheckpointError):
        _commit(plan.staged)
        if objects:
            with local_state_dict():
                module.load_state_dict(objects, strict=False)
        for state in iter_states(module):  # every parameter was in the checkpoint (keys match exactly)
            state.mark_loaded()
        if optimizer is not None:
            _apply_optimizer(plan, small, optimizer)


class _Plan:
    pass


def _plan(path: str, target_dir: str, module: nn.Module, optimizer, manifest: Optional[dict], verify: bool) -> _Plan:
    """What the metadata alone tells (no data read): the keys match, the targets to load into."""
    for state in iter_states(module):
        if state.unit is not None:
            state.reshard()  # any gathered copy would be stale after the load
    has_metadata = os.path.isfile(os.path.join(target_dir, ".metadata"))
    if verify and manifest is None and not has_metadata:
        raise CheckpointError(no_manifest_message(path, target_dir, False))
    meta = SafeFileSystemReader(target_dir).read_metadata()
    if manifest is not None:
        check_covered(path, meta, manifest)
    meta = meta.state_dict_metadata
    plan = _Plan()
    plan.meta, plan.reader_path = meta, target_dir
    plan.meta_file = os.path.join(target_dir, ".metadata")  # what metadata-derived errors name
    plan.unverified = verify and manifest is None  # refused once the compatibility checks ran
    index, infos = _sharded_params(module, loading=True)
    plan.infos = infos
    plan.staged = []  # read into copies: a failed read leaves the module as it was
    plan.target = _model_entries(module, infos, plan.staged)
    stored_model = {k for k in meta if k.startswith("model.")}
    try:
        _check_keys("model", set(plan.target), stored_model, plan.meta_file)
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
        plan.group_names = _optimizer_params(optimizer, index)
    return plan


def _check_plan(plan: _Plan, small: dict, module: nn.Module, optimizer, path: str) -> None:
    meta, infos, target = plan.meta, plan.infos, plan.target
    if "meta.param_shapes" in small:
        saved_shapes = _decode_small(small["meta.param_shapes"], "meta.param_shapes", path)
        if not isinstance(saved_shapes, dict):
            raise CheckpointError(f"load_checkpoint({path}): 'meta.param_shapes' is not a mapping of shapes")
        for name, shape in _param_shapes(infos).items():
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
    unknown = sorted(k for k in meta if not (k.startswith(("model.", "optim.state.")) or k in _SMALL_ENTRIES))
    if unknown and not plan.unverified:  # nothing is ignored: a renamed entry would drop its values silently
        raise KeyError(f"load_checkpoint({path}): {plan.meta_file} lists entries no save_checkpoint writes: "
                       f"{unknown[:5]}; the checkpoint is corrupted or not ours; nothing was loaded")
    if plan.unverified:
        raise CheckpointError(no_manifest_message(path, plan.reader_path, True))


def _check_optimizer_class(saved_class: Optional[dict], saved_groups: list, optimizer, path: str) -> None:
    mine = type(optimizer)
    if saved_class is not None:
        if saved_class.get("name") != mine.__qualname__:
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
    _check_optimizer_class(saved_class, saved_groups, optimizer, path)
    _check_groups(saved_groups, group_names, path)
    known = {n for names in group_names for n in names}
    prefix = "optim.state."
    stored_states: Dict[str, Dict[str, object]] = {}
    for key, m in meta.items():
        if not key.startswith(prefix):
            continue
        name, state_key = _split_state_key(key[len(prefix):], known)
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
                local[key] = torch.empty(p.shape, dtype=dtype, device=p.device)
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


def _load(target: dict, path: str, directory: str) -> None:
    """dcp.load, whose failures (gathered from every rank into a CheckpointException on
    every rank) become a CheckpointError naming the failing ranks."""
    try:
        with _quiet():
            dcp.load(target, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner())
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


def _split_state_key(rest: str, known: set):
    """'blocks.0.w.weight.exp_avg' -> ('blocks.0.w.weight', 'exp_avg'). State keys may
    contain dots themselves ('ema.decay'), so the longest known parameter name that
    prefixes `rest` wins."""
    parts = rest.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        if name in known:
            return name, ".".join(parts[cut:])
    return None, None


def _check_groups(saved_groups, group_names, path: str) -> None:
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


def _check_keys(what: str, expected: set, stored: set, path: str) -> None:
    missing, extra = sorted(expected - stored), sorted(stored - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"in the checkpoint but not in the {what}: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise KeyError(f"load_checkpoint({path}): {what} keys differ; " + "; ".join(parts))
