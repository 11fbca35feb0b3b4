"""Sharded checkpoints through torch.distributed.checkpoint (DCP), reshardable across
world sizes and sharding strategies, and interchangeable with FSDP2's.

A checkpoint holds the state dicts torch's helpers give (get_model_state_dict,
get_optimizer_state_dict): every parameter, and every optimizer state tensor shaped like
one, is a DTensor of its full shape placed as FSDP2 places it, so DCP stores it once, in
its full shape, whatever the layout that wrote it. The keys are DCP's flattening of
{"model": ..., "optimizer": ...}, the layout torchtitan and torch's DCP recipe write,
plus two of ours:

    model.<name>                          parameters and buffers; extra state as one entry,
                                          the bytes of a torch.save that loads weights-only
    optimizer.state.<name>.<key>          per-parameter optimizer state
    optimizer.param_groups.<i>.<key>      hyper-parameters, and the group's parameter names
    meta.format                           {"format": "torch_state_dict", "version": 2}, JSON
    meta.optimizer_class                  the optimizer's class (SGD's state is no AdamW's), JSON

torch's dcp.load with the same helpers reads these checkpoints (into FSDP2 or plain
models), and load_checkpoint(..., verify=False) reads theirs. Checkpoints of the flat
format that save_checkpoint wrote before (dcp_flat) still load.

Loading runs nothing from the files (reader.py): DCP's .metadata is read through a
restricted unpickler, values stored as bytes load weights-only, our metadata is JSON.

save_checkpoint publishes a checkpoint only once it is whole: all ranks agree on the
directory, write into a fresh sibling directory, hash what they wrote, and rank 0 writes
the manifest (mfsdp_manifest.json: every file with its size; .metadata with its sha256,
each data file with the sha256 of every entry's byte range) once every rank has, then
swaps the directory into place with renames. The writing ranks meet through the job's
c10d store with a deadline (writer.py), so a stalled rank is named instead of
holding the others, and async_save=True runs it on a thread after copying the state to
host memory. load_checkpoint refuses a directory without the manifest; each rank reads
the entries it needs on several threads, hashing each one's bytes as it reads them, and
nothing is loaded before every rank found its bytes to match; it reads each rank's
pieces of the shards directly where it can (pieces.py). Every failure is raised
on every rank. The file handling (manifest, hashes, renames, rank agreement) lives in
files.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..core import backends, shard_changes
from ..core.agree import Agreement, gather_objects, rank_world
from .files import (  # CheckpointError and MANIFEST_NAME are also this module's API
    MANIFEST_NAME, CheckpointError, check_covered, check_replaceable, check_same_path, moved_aside, no_manifest_message,
    Verification, read_manifest, refuse_corrupted, remove_stale_temporaries, sibling,
)
from .writer import (  # noqa: F401  (AsyncSave, release_async_save_buffers: this module's API too)
    AsyncSave, SaveJob, checkpoint_timeout, release_async_save_buffers, stage_on_host, start_async_save,
    temporaries_in_use, wait_for_previous_save, write_and_publish,
)
from .pieces import PieceTarget, piece_targets, read_locally, set_at
from .reader import SafeFileSystemReader, decode_json, decode_object, encode_json, encode_object
from .dcp_flat import (check_covers_world, optimizer_state_kind, check_groups, check_keys, check_optimizer_class, finish_load,
                       is_flat_format, plan_load, read_into)
from ..core.param_index import iter_states
from ..core.state_dict import local_state_dict, unread_values
from ..core.dtensor_face import is_dtensor

FORMAT = {"format": "torch_state_dict", "version": 2}
_FORMAT_KEY = "meta.format"
_CLASS_KEY = "meta.optimizer_class"
_OURS = (_FORMAT_KEY, _CLASS_KEY)
# Files (and writer threads) per rank, written and hashed at save in parallel (one
# file's hashing is sequential: a rank's single file of a large model would take seconds).
_WRITE_THREADS = max(1, min(4, os.cpu_count() or 1))
# Threads that read (hash, and load) a rank's entries at load: the host's cores shared
# among the ranks on it (LOCAL_WORLD_SIZE, as torchrun sets it), at most 8.
_LOCAL_WORLD = os.environ.get("LOCAL_WORLD_SIZE", "1")
_READ_THREADS = max(1, min(8, (os.cpu_count() or 1) // max(1, int(_LOCAL_WORLD) if _LOCAL_WORLD.isdigit() else 1)))


# ----------------------------------------------------------------------------- the state dict

def _check_optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    mine = {id(p) for p in module.parameters()}
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in mine]
        if missing:
            raise ValueError(
                "sharded checkpoint: the optimizer holds a parameter that is not in the module "
                f"(shape {tuple(missing[0].shape)}); build the optimizer from module.parameters()")


def _check_loadable(tree: dict, what: str) -> None:
    """Values DCP stores as bytes (extra state, hyper-parameters) load weights-only: what
    could not (arbitrary classes) is refused here, at save, naming the key."""
    flat, _ = flatten_state_dict(tree)
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            encode_object(value, f"{what}: '{key}'")


def _is_extra_state(key: str) -> bool:
    return key.endswith("._extra_state") or key == "_extra_state"


def sharded_state_dict(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """What save_checkpoint hands to torch.distributed.checkpoint.save: torch's
    get_model_state_dict (and get_optimizer_state_dict) of the sharded model, under
    "model" (and "optimizer"), plus our format and optimizer-class entries. Collective (the
    state dicts exchange each unit's rows): call on all ranks. For storage other than a
    filesystem directory, pass it to dcp.save yourself; such a checkpoint has no manifest,
    so nothing verifies it is whole (load_checkpoint(..., verify=False) reads it)."""
    check_covers_world(iter_states(module))
    if optimizer is not None:
        _check_optimizer_params(module, optimizer)
        shard_changes.adopt(optimizer)  # its state dict speaks full shapes even before its first step
    model_sd = get_model_state_dict(module)
    for key in model_sd:
        if _is_extra_state(key):
            # One opaque entry (a torch.save that loads weights-only), as the module's
            # get_extra_state gave it: DCP would otherwise flatten a dict into keys that
            # a model whose extra state differs in structure could not load into.
            model_sd[key] = encode_object(model_sd[key], f"sharded checkpoint: module state '{key}'")
    sd = {"model": model_sd, _FORMAT_KEY: encode_json(FORMAT)}
    if optimizer is not None:
        sd["optimizer"] = get_optimizer_state_dict(module, optimizer)
        _check_loadable(sd["optimizer"], "sharded checkpoint: optimizer state")
        # Beside the hyper-parameters: load_checkpoint refuses another optimizer class.
        sd[_CLASS_KEY] = encode_json({"name": type(optimizer).__qualname__, "module": type(optimizer).__module__,
                                      "state_kind": optimizer_state_kind(type(optimizer))})
    return sd


# ----------------------------------------------------------------------------- save and load

def _refuse_without_data(what: str) -> None:
    if dist.is_available() and dist.is_initialized():
        backends.check_moves_data(what, dist.group.WORLD)


def save_checkpoint(path: str, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    async_save: bool = False) -> Optional[AsyncSave]:
    """Save model (and optimizer) state to directory `path`, replacing the checkpoint
    there only once the new one is complete. Collective: call on all ranks, with the
    same path.

    The ranks write into a fresh sibling directory; when every write succeeded, each rank
    hashes its files (each entry's byte range), rank 0 writes the manifest
    (mfsdp_manifest.json: every file's size and hashes) and renames the directory into
    place. A failure on any rank (a full disk, a
    crash in a write) raises CheckpointError on every rank naming the failing rank(s);
    so does a rank that stalls longer than the checkpoint timeout (the units'
    fully_shard(timeout=...), else the default group's), once that timeout has passed.
    The previous checkpoint at `path` is then left as it was. Different paths on different
    ranks raise ValueError on every rank before anything is written. `path` must be new,
    or a directory holding only a checkpoint; temporary directories a killed save left
    beside it are removed. For storage other than a filesystem, pass sharded_state_dict()
    to torch.distributed.checkpoint.save yourself (unverified).

    async_save=True returns an AsyncSave as soon as the state is copied to host memory
    (pinned, for CUDA tensors; the buffers are kept for the next asynchronous save,
    release_async_save_buffers() frees them): training may change the parameters and
    optimizer state right away. The files are written, hashed and published on a
    background thread, which issues no collective (the ranks meet through the job's
    c10d store). handle.result() waits and raises the save's CheckpointError; the next
    save_checkpoint or load_checkpoint waits for it first, and raises its failure on
    every rank if no result() call did. Wait for it before destroying the process group."""
    _refuse_without_data("save_checkpoint")
    rank, world = rank_world()
    target = os.path.abspath(os.fspath(path))
    what = f"save_checkpoint({path})"
    token = uuid.uuid4().hex[:16] if rank == 0 else None

    def same_path(shared: Dict[int, Tuple[str, Optional[str]]], _) -> None:  # outranks any failure
        check_same_path("save_checkpoint", {r: p for r, (p, _token) in shared.items()})

    with Agreement(what, error=CheckpointError, share=(target, token), check=same_path) as prepared:
        previous_failure = wait_for_previous_save(what)
        # Collective (every rank makes the state dicts, even one that is about to raise).
        sd = sharded_state_dict(module, optimizer)
        if previous_failure is not None:
            raise previous_failure
        if async_save:  # before returning: training may change the parameters next
            sd = stage_on_host(sd)
        if rank == 0:
            check_replaceable(target)
            remove_stale_temporaries(target, in_use=temporaries_in_use())
    token = prepared.shared[0][1]
    job = SaveJob(what=what, target=target, tmp=sibling(target, "tmp", token), token=token, rank=rank, world=world,
                  timeout_s=checkpoint_timeout(module), write_threads=_WRITE_THREADS)
    if async_save:
        return start_async_save(job, sd)
    write_and_publish(job, sd)
    return None


def load_checkpoint(path: str, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    verify: bool = True) -> None:
    """Load a checkpoint written by save_checkpoint, under any world size and sharding
    strategy, into `module` (and `optimizer`, whose state is replaced). Collective: call
    on all ranks, with the same path.

    Before anything is loaded: the ranks must agree on the path (ValueError otherwise);
    the directory must hold the manifest save_checkpoint writes last, every file must
    have its size there, and every entry read must match its sha256 there (each rank
    hashes what it reads; CheckpointError naming the file and the entry otherwise, on
    every rank; manifests of one sha256 per file, from earlier versions, have each file
    hashed whole by one rank); keys must match exactly (a missing or extra key, or a
    shape mismatch, is an error naming the key); the optimizer must be of the class that
    was saved. Every error is raised on every rank. verify=False skips the manifest and
    hashes and checks each entry's zip CRC-32 alone (for checkpoints written with
    dcp.save(sharded_state_dict(...)), or by torch's helpers under the same keys).
    Checkpoints of the earlier flat format load too."""
    _refuse_without_data("load_checkpoint")
    rank, world = rank_world()
    target = os.path.abspath(os.fspath(path))
    what = f"load_checkpoint({path})"
    check_same_path("load_checkpoint", gather_objects(target))

    # Local checks: the previous save done, the manifest and .metadata checked (the data
    # files are checked as they are read, or hashed whole on a thread: Verification),
    # then what the metadata alone tells. Agreed in one collective; a corrupted file
    # outranks any other error.
    with Agreement(what, error=CheckpointError, share=[],
                   check=lambda shared, _: refuse_corrupted(what, shared)) as checked:
        previous_failure = wait_for_previous_save(what)  # it may be writing this very directory
        if previous_failure is not None:
            raise previous_failure
        if not os.path.isdir(target):
            raise FileNotFoundError(f"{what}: no checkpoint directory at {target}{moved_aside(target)}")
        manifest = read_manifest(path, target) if verify else None
        verification = Verification(what, target, manifest, rank, world, _WRITE_THREADS)
        checked.share = verification.metadata_bad
        if not checked.share:
            metadata = _read_metadata(path, target, manifest, verify)
            verification.start(metadata)
            meta = metadata.state_dict_metadata
            unverified = verify and manifest is None  # refused once the compatibility checks ran
            for state in iter_states(module):
                if state.unit is not None:
                    state.reshard()  # any gathered copy would be stale after the load
            if optimizer is not None:
                # Its state dicts speak full shapes from now on, before its first step too.
                shard_changes.adopt(optimizer)
            flat_plan = None
            if is_flat_format(meta, module):  # the earlier format loads as before: verified first
                checked.share = verification.corrupted()
                if not checked.share:
                    flat_plan = plan_load(path, target, module, optimizer, meta, unverified)
    if flat_plan is not None:
        finish_load(flat_plan, path, module, optimizer, verification, _READ_THREADS)
    else:
        _load_state_dicts(path, target, module, optimizer, metadata, unverified, verification)


def _read_metadata(path: str, target: str, manifest: Optional[dict], verify: bool):
    if verify and manifest is None and not os.path.isfile(os.path.join(target, ".metadata")):
        raise CheckpointError(no_manifest_message(path, target, False))
    metadata = SafeFileSystemReader(target).read_metadata()
    if manifest is not None:
        check_covered(path, metadata, manifest)
    return metadata


def _copies(tree, fresh: Dict[int, tuple]):
    """The state dict's containers and plain tensors copied (the DTensors our state-dict
    hooks return, and the values in `fresh`, are new already): DCP reads into these, so
    that a failed read leaves the model and optimizer as they were."""
    if isinstance(tree, dict):
        return {k: _copies(v, fresh) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copies(v, fresh) for v in tree)
    if isinstance(tree, torch.Tensor) and not is_dtensor(tree) and id(tree) not in fresh:
        return tree.detach().clone()
    return tree


def _load_state_dicts(path: str, directory: str, module: nn.Module, optimizer, metadata, unverified: bool,
                      verification: Verification) -> None:
    """A checkpoint of torch's state dicts: read into targets laid out as torch's helpers
    give them (state_dict.unread_values: no collective fills them), checked against the
    metadata first; each stage agreed on every rank, the values loaded only once every
    rank found what it read to match the manifest. Where every sharded value is a unit's own, each rank reads
    its pieces of the shards directly (pieces.py) and loads them as they are;
    otherwise DCP reads the DTensors and the state-dict hooks cut them (an exchange)."""
    what = f"load_checkpoint({path})"
    meta = metadata.state_dict_metadata
    meta_file = os.path.join(directory, ".metadata")

    with verification.stage():  # before any state dict is made
        check_covers_world(iter_states(module))
        small = {k: "" for k in _OURS if k in meta and (optimizer is not None or k == _FORMAT_KEY)}
        groups = {k: [] for k in _group_keys(meta)}  # every saved group, ours or not
        if small or groups:
            loaded = read_locally(directory, metadata, {**small, **groups}, verification)
            small, groups = {k: loaded[k] for k in small}, {k: loaded[k] for k in groups}
        _check_format(path, meta_file, small)
        if optimizer is not None:
            _check_optimizer_params(module, optimizer)
            _check_optimizer_class(path, meta_file, meta, small, optimizer)
    # torch's get_optimizer_state_dict gives a fresh optimizer its state (a step with zero
    # gradients and lr 0): a load refused after that takes it back.
    fresh = optimizer is not None and not optimizer.state
    try:
        with unread_values() as made:
            targets = {"model": _copies(get_model_state_dict(module), made)}
            if optimizer is not None:
                targets["optimizer"] = _copies(get_optimizer_state_dict(module, optimizer), made)
        extra = [k for k in targets["model"] if _is_extra_state(k)]
        for key in extra:
            targets["model"][key] = b""  # read as saved (opaque bytes), decoded below
        flat, mappings = flatten_state_dict(targets)
        with verification.stage():
            try:
                _check_against_metadata(path, meta_file, meta, flat, groups, optimizer)
            except (KeyError, ValueError) as e:
                if unverified:  # not ours at all: say what it is and how to load it
                    raise CheckpointError(no_manifest_message(path, directory, True) + f" (It differs too: {e})") from e
                raise
            if unverified:
                raise CheckpointError(no_manifest_message(path, directory, True))
        pieces = piece_targets(flat, made)  # the same on every rank: the units and the keys agree
        with verification.read_stage():
            if pieces is not None:
                for key, value in read_locally(directory, metadata, pieces, verification, _READ_THREADS).items():
                    set_at(targets, mappings[key], value)
                for key, value in pieces.items():
                    if isinstance(value, PieceTarget):
                        set_at(targets, mappings[key], value.piece)
            else:
                read_into(targets, path, directory, metadata=metadata, verification=verification,
                          threads=_READ_THREADS)
            for key in extra:
                targets["model"][key] = decode_object(targets["model"][key], f"{what}: 'model.{key}'")
    except BaseException:
        if fresh:
            optimizer.state.clear()
        raise
    with Agreement(what, error=CheckpointError):
        # Pieces load as they are (no exchange); otherwise the hooks cut each value.
        with local_state_dict() if pieces is not None else contextlib.nullcontext():
            set_model_state_dict(module, targets["model"])
            for state in iter_states(module):  # every parameter was in the checkpoint (keys match exactly)
                state.mark_loaded()
            if optimizer is not None:
                set_optimizer_state_dict(module, optimizer, targets["optimizer"])


def _check_format(path: str, meta_file: str, small: dict) -> None:
    """A checkpoint that is not of the flat format names its format; torch's helpers
    write none (its keys are then checked like ours)."""
    if _FORMAT_KEY not in small:
        return
    fmt = decode_json(small[_FORMAT_KEY], f"load_checkpoint({path}): '{_FORMAT_KEY}'")
    if not isinstance(fmt, dict) or fmt.get("format") != FORMAT["format"]:
        raise CheckpointError(f"load_checkpoint({path}): '{_FORMAT_KEY}' in {meta_file} names format {fmt!r}, not "
                              f"{FORMAT['format']!r}; nothing was loaded")
    if not isinstance(fmt.get("version"), int) or fmt["version"] > FORMAT["version"]:
        raise CheckpointError(f"load_checkpoint({path}): the checkpoint is of format version {fmt.get('version')!r}; "
                              f"this version of megatron_fsdp_ext reads up to {FORMAT['version']}: upgrade it")


def _check_optimizer_class(path: str, meta_file: str, meta, small: dict, optimizer) -> None:
    if not any(k.startswith("optimizer.param_groups.") for k in meta):
        raise KeyError(f"load_checkpoint: {meta_file} lists no optimizer state ('optimizer.param_groups' is "
                       "missing); load without an optimizer or pick a checkpoint saved with one")
    if _CLASS_KEY not in small:
        if _FORMAT_KEY not in small:
            return  # written by torch's helpers: another optimizer's hyper-parameters differ in their keys
        raise CheckpointError(f"load_checkpoint({path}): {meta_file} names no optimizer class ('{_CLASS_KEY}')")
    saved_class = decode_json(small[_CLASS_KEY], f"load_checkpoint({path}): '{_CLASS_KEY}'")
    if not isinstance(saved_class, dict):
        raise CheckpointError(f"load_checkpoint({path}): '{_CLASS_KEY}' does not name a class")
    check_optimizer_class(saved_class, [], optimizer, path)


def _group_keys(entries) -> List[str]:
    """'optimizer.param_groups.<i>.params' keys of `entries`, in group order."""
    found = [k for k in entries if k.startswith("optimizer.param_groups.") and k.endswith(".params")
             and k.split(".")[2].isdigit()]
    return sorted(found, key=lambda k: int(k.split(".")[2]))


def _check_against_metadata(path: str, meta_file: str, meta, flat: dict, groups: dict, optimizer) -> None:
    """Keys, shapes and kinds of the targets against the checkpoint's metadata, and the
    optimizer's parameter groups (`groups`: as saved): nothing is read before these pass."""
    def keys(prefix):
        return ({k for k in flat if k.startswith(prefix)},
                {k for k in meta if k.startswith(prefix) and k not in _OURS})

    check_keys("model", *keys("model."), path)
    if optimizer is not None:
        saved_groups = [{"params": groups[k]} for k in _group_keys(groups)]
        mine = [flat[k] for k in _group_keys(flat)]
        if any(not isinstance(g["params"], list) for g in saved_groups):
            raise CheckpointError(f"load_checkpoint({path}): the checkpoint's parameter groups do not list names")
        check_groups(saved_groups, mine, path)
        check_keys("optimizer", *keys("optimizer."), path)
    unknown = sorted(k for k in meta if not k.startswith(("model.", "optimizer.")) and k not in _OURS)
    if unknown:  # nothing is ignored: a renamed entry would drop its values silently
        raise KeyError(f"load_checkpoint({path}): {meta_file} lists entries no save_checkpoint writes: "
                       f"{unknown[:5]}; the checkpoint is corrupted or not ours; nothing was loaded")
    for key, value in flat.items():
        if key not in meta:
            continue
        stored = meta[key]
        if isinstance(value, torch.Tensor):
            if isinstance(stored, BytesStorageMetadata):
                raise ValueError(f"load_checkpoint: '{key}' is not a tensor in {meta_file}; the model's is a tensor "
                                 f"of shape {tuple(value.shape)}")
            if list(stored.size) != list(value.shape):
                raise ValueError(f"load_checkpoint: '{key}' has shape {tuple(stored.size)} in {meta_file}, the "
                                 f"model's has {tuple(value.shape)}")
