"""Atomic, verified checkpoint directories: the file handling behind dcp.save_checkpoint
and dcp.load_checkpoint, independent of what the checkpoint holds.

What it guarantees:

* all ranks agree on the path: different paths on different ranks are refused on every
  rank before anything is read or written (check_same_path);
* a save publishes by rename only after every rank succeeded: the ranks write into a
  fresh sibling directory, and rank 0 renames it into place (publish) only once every
  rank's write and hashing has succeeded; until then the previous checkpoint is untouched;
* a manifest (MANIFEST_NAME), written last and listing every file with its sha256 and
  size, is the completeness marker: a directory without it is an incomplete save;
* loads verify checksums: every file is hashed against the manifest (verify_share, each
  file by one rank) and every file the load would read must be listed (check_covered);
* every failure is agreed on and raised on every rank (agree.raise_agreed), naming the ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .agree import rank_world

MANIFEST_NAME = "mfsdp_manifest.json"
MANIFEST_FORMAT = "megatron_fsdp_ext.sharded_checkpoint"
MANIFEST_VERSION = 1
_OWN_FILES = re.compile(r"^(\.metadata|\.metadata\.tmp|__\d+_\d+\.distcp|" + re.escape(MANIFEST_NAME) + r"(\.part)?)$")
WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or not ours, or a save that failed."""


def from_rank0(obj):
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def check_same_path(what: str, paths: Dict[int, str]) -> None:
    """`paths`: every rank's, by rank (agree.gather_objects)."""
    if len(set(paths.values())) > 1:
        each = ", ".join(f"rank {r}: {p}" for r, p in paths.items())
        raise ValueError(f"{what}: the ranks were given different checkpoint paths ({each}); every rank must "
                         "pass the same directory (nothing was read or written)")


def sibling(target: str, kind: str, token: str) -> str:
    head, name = os.path.split(target)
    return os.path.join(head, f".{name}.mfsdp-{kind}-{token}")


def file_digest(path: str) -> Tuple[str, int]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return digest, os.fstat(f.fileno()).st_size


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(target: str) -> None:
    """save_checkpoint replaces the whole directory: refuse one holding anything else."""
    if os.path.islink(target):
        raise ValueError(f"save_checkpoint: {target} is a symbolic link; pass the directory itself")
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise ValueError(f"save_checkpoint: {target} exists and is not a directory")
    strangers = sorted(n for n in os.listdir(target)
                       if not _OWN_FILES.match(n) or not os.path.isfile(os.path.join(target, n)))
    if strangers:
        raise ValueError(
            f"save_checkpoint: {target} exists and holds {strangers[:5]}{' ...' if len(strangers) > 5 else ''}, "
            "which save_checkpoint does not write; a save replaces the whole directory, so pick a new or empty "
            "one (nothing was written)"
        )


def publish(target: str, tmp: str, token: str, files: Dict[str, Tuple[str, int]], world: int) -> None:
    """Rank 0: write the manifest (the completeness marker) into `tmp`, then swap `tmp`
    in for `target`. Until the second rename, `target` is the previous checkpoint."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "world_size": world,
        "files": {name: {"sha256": digest, "size": size} for name, (digest, size) in sorted(files.items())},
    }
    part = os.path.join(tmp, MANIFEST_NAME + ".part")
    with open(part, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, os.path.join(tmp, MANIFEST_NAME))
    _fsync_dir(tmp)
    old = None
    if os.path.lexists(target):
        check_replaceable(target)  # again: it may have changed while we wrote
        old = sibling(target, "old", token)
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    # The new checkpoint is in place: what follows only makes it durable and frees space.
    try:
        _fsync_dir(os.path.dirname(target))
        if old is not None:
            shutil.rmtree(old)
    except OSError as e:
        warnings.warn(f"save_checkpoint: {target} is saved, but cleaning up failed ({e}); the previous checkpoint "
                      f"may remain at {old}", stacklevel=3)


def moved_aside(target: str) -> str:
    """Where a save interrupted between its two renames left the previous checkpoint."""
    head, name = os.path.split(target)
    try:
        aside = sorted(n for n in os.listdir(head) if n.startswith(f".{name}.mfsdp-old-"))
    except OSError:
        return ""
    if not aside:
        return ""
    return f" (a save_checkpoint interrupted while swapping directories left the previous one at " \
           f"{os.path.join(head, aside[-1])}: rename it back)"


def no_manifest_message(path: str, target: str, has_metadata: bool) -> str:
    msg = (f"load_checkpoint({path}): {target} has no {MANIFEST_NAME}, which save_checkpoint writes last: it is "
           "an incomplete or interrupted save, or was not written by save_checkpoint; it cannot be verified and "
           "was not loaded.")
    if not has_metadata:
        return msg + " (It holds no torch.distributed.checkpoint .metadata either.)"
    return msg + (
        " It is a torch.distributed.checkpoint (DCP) checkpoint: if another tool wrote it (torch's state-dict "
        "helpers, FSDP2, torchtitan), load it with dcp.load({'model': get_model_state_dict(model), 'optimizer': "
        "get_optimizer_state_dict(model, opt)}, checkpoint_id=path) then set_model_state_dict / "
        "set_optimizer_state_dict (torch.distributed.checkpoint.state_dict), which these models support; if it was "
        "written with dcp.save(sharded_state_dict(...)) and you trust it, load_checkpoint(path, model, opt, "
        "verify=False) loads it unverified."
    )


def read_manifest(path: str, target: str) -> Optional[dict]:
    where = os.path.join(target, MANIFEST_NAME)
    if not os.path.exists(where):
        return None
    try:
        with open(where) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"load_checkpoint({path}): {where} is unreadable ({e}): the checkpoint is corrupted; "
                              "nothing was loaded") from e
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise CheckpointError(f"load_checkpoint({path}): {where} is not a manifest written by save_checkpoint; "
                              "nothing was loaded")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > MANIFEST_VERSION:
        raise CheckpointError(f"load_checkpoint({path}): manifest version {manifest.get('version')!r} is newer than "
                              f"this library reads ({MANIFEST_VERSION}); upgrade megatron_fsdp_ext")
    return manifest


def verify_share(target: str, manifest: dict, rank: int, world: int) -> List[str]:
    """Hash this rank's share of the manifest's files: what differs, one line per file."""
    bad = []
    for i, name in enumerate(sorted(manifest["files"])):
        if i % world != rank:
            continue
        entry = manifest["files"][name]
        where = os.path.join(target, name)
        if not os.path.isfile(where):
            bad.append(f"'{name}' is listed in the manifest but missing")
            continue
        digest, size = file_digest(where)
        if digest != entry.get("sha256") or size != entry.get("size"):
            bad.append(f"'{name}' has sha256 {digest} ({size} bytes), the manifest expects {entry.get('sha256')} "
                       f"({entry.get('size')} bytes)")
    return bad


def check_covered(path: str, meta, manifest: dict) -> None:
    """Every file DCP would read is one the manifest vouches for."""
    listed = set(manifest["files"])
    needed = {".metadata"} | {getattr(s, "relative_path", None) for s in (meta.storage_data or {}).values()}
    unlisted = sorted(n for n in needed - listed if n is not None)
    if unlisted:
        raise CheckpointError(f"load_checkpoint({path}): its .metadata points at {unlisted[:5]}, which its manifest "
                              "does not list: it is corrupted or was modified after the save; nothing was loaded")
