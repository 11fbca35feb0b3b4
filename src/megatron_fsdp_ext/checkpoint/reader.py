"""Reading checkpoint bytes as data, never as code.

A checkpoint is often downloaded or handed over, and its manifest proves completeness,
not trust. So nothing read from one may run code:

- DCP's `.metadata` (torch unpickles it whole) is read by `SafeFileSystemReader` through
  an unpickler that admits only the classes DCP's metadata is made of (its dataclasses
  and enums, torch.Size, dtypes, layouts, paths, builtin containers); anything else is a
  CheckpointError naming the file and the class.
- Tensor entries (torch.save archives) are read by `tensor_entry`: the zip directory by
  hand, data.pkl through an unpickler that admits only what torch.save writes for one
  tensor (any other global is a CheckpointError naming the file and the entry), the
  tensor a view of the bytes read, or those bytes read straight into the destination;
  safe tensors of another form (a conjugate bit, big-endian) load weights-only.
- Values DCP stores as bytes (our metadata, extra state, non-tensor optimizer state; torch
  would `torch.load(..., weights_only=False)` them) are loaded by `SafeLoadPlanner` with
  `weights_only=True`: tensors, numbers, strings, bytes and builtin containers, plus what
  the user put on torch's own allow-list (`torch.serialization.add_safe_globals`).
- Our own metadata is JSON (`encode_json` / `decode_json`); module extra state is stored
  as a weights-only `torch.save` (`encode_object` refuses at save what could not load).
- Any failure while reading a file is a CheckpointError naming that file.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import pickletools
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.futures import Future

from . import tensor_entry
from .files import CheckpointError, EntryCheck, zip_crc_problem

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_MAX_METADATA_BYTES = 1 << 30
# Out-of-band buffers, persistent ids and extension codes: never in DCP's metadata.
_REFUSED_OPCODES = {"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"}
_DCP_FILESYSTEM_CLASSES = {"_StorageInfo"}
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes", "complex"}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


def _opcode_table() -> List[Any]:
    """Per opcode byte, how its argument is laid out: a fixed size in bytes; ("count",
    bytes, signed) for a length field followed by that many bytes; ("lines", n) for n
    newline-terminated lines; "stop"; ("refused", name); None for no opcode."""
    table: List[Any] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if op.name in _REFUSED_OPCODES:
            kind: Any = ("refused", op.name)
        elif op.name == "STOP":
            kind = "stop"
        elif arg is None:
            kind = 0
        elif arg.n >= 0:
            kind = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind = ("lines", 2 if arg.name == "stringnl_noescape_pair" else 1)
        else:
            kind = ("count", {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                              pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}[arg.n],
                    arg.n == pickletools.TAKEN_FROM_ARGUMENT4)
        table[ord(op.code)] = kind
    return table


_OPCODES = _opcode_table()


def check_pickle_lengths(data: bytes) -> None:
    """Walk the opcodes of the pickle `data` up to its STOP without decoding anything:
    every opcode known and admitted (_REFUSED_OPCODES are not), and every argument,
    counted ones included, within the data. ValueError otherwise."""
    table, end, at = _OPCODES, len(data), 0
    while at < end:
        kind = table[data[at]]
        at += 1
        if type(kind) is int:
            at += kind
            continue
        if kind is None:
            raise ValueError(f"unknown pickle opcode {data[at - 1]:#04x} at byte {at - 1}")
        if kind == "stop":
            return
        if kind[0] == "refused":
            raise ValueError(f"pickle opcode {kind[1]}, which DCP's metadata never uses")
        if kind[0] == "lines":
            for _ in range(kind[1]):
                newline = data.find(b"\n", at)
                if newline < 0:
                    raise ValueError(f"a pickle argument at byte {at} has no end of line")
                at = newline + 1
            continue
        _, width, signed = kind
        if at + width > end:
            break
        count = int.from_bytes(data[at:at + width], "little", signed=signed)
        at += width
        if count < 0 or at + count > end:
            raise ValueError(f"a pickle argument at byte {at} claims {count} bytes; {end - at} follow")
        at += count
    raise ValueError(f"the pickle ends (at byte {end}) before its STOP opcode")


def _torch_value(name: str):
    """torch.<name> when it is a dtype, layout or memory format (how they pickle)."""
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if module == _DCP_METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as md
            found = getattr(md, name, None)
            if isinstance(found, type) and (hasattr(found, "__dataclass_fields__") or issubclass(found, enum.Enum)):
                return found
        elif module == "torch.distributed.checkpoint.filesystem" and name in _DCP_FILESYSTEM_CLASSES:
            import torch.distributed.checkpoint.filesystem as fs
            return getattr(fs, name)
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and _torch_value(name) is not None:
            return _torch_value(name)
        elif module == "torch.serialization" and name == "_get_layout":
            return _layout_by_name
        elif module == "pathlib" and name in _PATHS:
            return getattr(pathlib, name)
        elif module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        elif module == "collections" and name == "OrderedDict":
            from collections import OrderedDict
            return OrderedDict
        raise CheckpointError(
            f"{self.where}: refuses to load class {module}.{name}: a checkpoint's metadata holds only DCP's "
            "metadata types, and loading any other class could run code from the file")


def _layout_by_name(name: str) -> torch.layout:
    """torch.layout from its string (how torch pickles layouts), without torch's helper."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"unknown torch layout {name!r}")


def read_metadata_file(path: str):
    """DCP's Metadata from the file at `path`, through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        size = os.path.getsize(path)
        if size > _MAX_METADATA_BYTES:
            raise ValueError(f"{size} bytes, more than any DCP metadata file this reader accepts "
                             f"({_MAX_METADATA_BYTES})")
        with open(path, "rb") as f:
            data = f.read()
        # Walked once first (bounds-checked): a length field the file garbled must not
        # make the C unpickler allocate what the file does not hold.
        check_pickle_lengths(data)
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated, garbled: data that is not a pickle of DCP's metadata
        raise CheckpointError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's checkpoint metadata")
    try:
        _validate(metadata)
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed DCP metadata ({e})") from e
    return metadata


def _is_size(value, ndim=None) -> bool:
    return (isinstance(value, (torch.Size, tuple, list)) and all(isinstance(v, int) and v >= 0 for v in value)
            and (ndim is None or len(value) == ndim))


def _check_tiling(fqn: str, entry) -> None:
    """The chunks of a tensor entry cover it exactly once. DCP reads, for each part of a
    target, whatever chunks overlap it and leaves a part no chunk covers as it was: a
    .metadata whose chunk offsets changed (two chunks at one place, a gap elsewhere) would
    otherwise load the target's old values there, silently."""
    chunks = [c for c in entry.chunks if math.prod(c.sizes) > 0]
    total = sum(math.prod(c.sizes) for c in chunks)
    if total != math.prod(entry.size):
        raise ValueError(f"entry '{fqn}' of size {tuple(entry.size)} ({math.prod(entry.size)} elements) has chunks "
                         f"of {total} elements in all: they do not cover it exactly once")
    if len(chunks) < 2:
        return
    # Equal volumes: the chunks tile the entry exactly when no two overlap.
    starts = np.array([list(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    ends = starts + np.array([list(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), -1)
    for first in range(0, len(chunks), 512):  # blocks of rows: bounded memory for many chunks
        a_start, a_end = starts[first:first + 512, None, :], ends[first:first + 512, None, :]
        overlap = np.all((a_start < ends[None, :, :]) & (starts[None, :, :] < a_end), axis=2)
        rows = np.arange(first, first + overlap.shape[0])
        overlap[np.arange(overlap.shape[0]), rows] = False  # a chunk with itself
        if overlap.any():
            i, j = np.argwhere(overlap)[0]
            raise ValueError(f"entry '{fqn}' has overlapping chunks at {tuple(chunks[first + i].offsets)} and "
                             f"{tuple(chunks[j].offsets)}: they do not cover it exactly once")


def _validate(metadata) -> None:
    """Every field DCP and the loader read has the type and range it must: a field the
    file renamed, retyped or made negative is an error here, not inside DCP."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise TypeError("state_dict_metadata is not a mapping")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise TypeError(f"entry key {fqn!r} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.properties, TensorProperties):
            raise TypeError(f"entry '{fqn}' is a {type(entry).__name__}, not tensor or bytes metadata")
        if not isinstance(entry.properties.dtype, torch.dtype) or not _is_size(entry.size):
            raise TypeError(f"entry '{fqn}' has dtype {entry.properties.dtype!r} and size {entry.size!r}")
        if not isinstance(entry.chunks, list):
            raise TypeError(f"entry '{fqn}' has no chunk list")
        for chunk in entry.chunks:
            ndim = len(entry.size)
            if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets, ndim)
                    and _is_size(chunk.sizes, ndim)
                    and all(o + n <= s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise ValueError(f"entry '{fqn}' of size {tuple(entry.size)} has a chunk outside it: {chunk!r}")
        _check_tiling(fqn, entry)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise TypeError("storage_data is not a mapping")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or index.fqn not in entries:
            raise ValueError(f"storage entry {index!r} belongs to no entry of the checkpoint")
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            raise ValueError(f"storage of '{index.fqn}' names data file {name!r}, which is not a file of the "
                             "checkpoint's own directory")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise ValueError(f"storage of '{index.fqn}' is at offset {offset!r}, length {length!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise TypeError(f"storage of '{index.fqn}' has transform descriptors {descriptors!r}")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read through the restricted unpickler, every data
    file's read failure named, and the entries read by several threads.

    metadata: the checkpoint's `.metadata` as read_metadata_file gave it, so that the
    several reads of one load parse it once. verification: the load's
    files.py's Verification, which checks each entry's bytes as they are read
    (against the manifest, and their zip CRC-32) and records what differs; None (a load
    that verifies nothing but the CRC, as with verify=False): the reader checks each
    entry's CRC-32 itself. threads: how many entries are read (and hashed, and loaded) at
    a time. A planner whose `fills_fresh_tensors` is true (targets nothing reads unless
    the load is agreed on) has large entries read straight into its tensors, before
    their bytes are checked."""

    def __init__(self, path, *, metadata=None, verification=None, threads: int = 1):
        super().__init__(path)
        self._known_metadata = metadata
        self._verification = verification
        self._threads = max(1, int(threads))

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        if rank is None and self._known_metadata is not None:
            metadata = self._known_metadata
        else:
            metadata = read_metadata_file(os.path.join(os.fspath(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner):
        # Entries stored plainly (no storage transform: what save_checkpoint writes) are
        # read here, each once however many read items it serves: its bytes checked
        # (their sha256 against the manifest, the zip CRC-32 of its members) before they
        # are loaded, so that a changed byte is an error, not a different value, even
        # where the manifest was recomputed over it, or no manifest vouches for the files
        # (verify=False). Large entries whose destinations are fresh go straight into
        # them, checked block by block as they arrive (_stream_entry); the others are read
        # whole into a thread's buffer and their tensors made over it (_read_entry).
        # Threads read runs of entries of one file each; a failure names the file.
        # Transformed entries go through DCP's own reader, their bytes checked against the
        # manifest first.
        by_file: Dict[str, Dict[Any, List]] = {}
        transformed: Dict[str, List] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CheckpointError(f"{self._metadata_file()}: lists chunk {item.storage_index.fqn} at "
                                      f"{tuple(item.storage_index.offset or ())} but no storage for it")
            if getattr(info, "transform_descriptors", None):
                transformed.setdefault(info.relative_path, []).append(item)
            else:
                by_file.setdefault(info.relative_path, {}).setdefault(item.storage_index, []).append(item)
        runs = _runs({name: sorted(entries.items(), key=lambda e: self.storage_data[e[0]].offset)
                      for name, entries in by_file.items()},
                     lambda entry: self.storage_data[entry[0]].length, self._threads)
        lock = None if getattr(planner, "reads_concurrently", False) else threading.Lock()
        stop = threading.Event()
        per_thread = threading.local()
        scratches: List[_Scratch] = []

        def read_run(run) -> None:
            relative_path, entries = run
            where = os.path.join(os.fspath(self.path), relative_path)
            scratch = getattr(per_thread, "scratch", None)
            if scratch is None:
                scratch = per_thread.scratch = _Scratch()
                scratches.append(scratch)
            try:
                with open(where, "rb", buffering=0) as f:
                    for index, items in entries:
                        if stop.is_set():
                            return
                        self._read_entry(f, relative_path, index, items, planner, lock, scratch)
            except BaseException as e:
                stop.set()
                self._raise_named(where, e)

        try:
            if len(runs) <= 1 or self._threads == 1:
                for run in runs:
                    read_run(run)
            else:
                with ThreadPoolExecutor(max_workers=min(self._threads, len(runs)),
                                        thread_name_prefix="mfsdp-read") as pool:
                    done = [pool.submit(read_run, run) for run in runs]
                for future in done:  # the first failure, in the order of the runs
                    if future.exception() is not None:
                        raise future.exception()
        finally:
            for scratch in scratches:
                scratch.finish()
        for relative_path, items in transformed.items():
            where = os.path.join(os.fspath(self.path), relative_path)
            try:
                self._read_transformed(where, relative_path, items, plan, planner)
            except BaseException as e:
                self._raise_named(where, e)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _raise_named(where: str, e: BaseException) -> None:
        """Raise `e`, a failure reading the file at `where`, as a CheckpointError naming it."""
        if isinstance(e, CheckpointError) or not isinstance(e, Exception):
            raise e
        # Where the bytes are, .metadata says: either file may be at fault.
        raise CheckpointError(f"{where}: reading failed at the places .metadata gives ({type(e).__name__}: {e})") from e

    def _read_transformed(self, where: str, relative_path: str, items: List, plan: LoadPlan, planner) -> None:
        if self._verification is not None:
            with open(where, "rb") as f:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    f.seek(info.offset)
                    if not self._verification.check_entry(relative_path, item.storage_index.fqn, info.offset,
                                                          info.length, f.read(info.length), zip_members=False):
                        return  # recorded: nothing of the file is loaded
        super().read_data(LoadPlan(items=items, storage_data=plan.storage_data, planner_data=plan.planner_data),
                          planner)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        # (key, chunk offsets) -> (dtype, chunk sizes), as .metadata says
        self._chunks = {(fqn, tuple(chunk.offsets)): (entry.properties.dtype, tuple(chunk.sizes))
                        for fqn, entry in metadata.state_dict_metadata.items()
                        if isinstance(entry, TensorStorageMetadata) for chunk in entry.chunks}

    def _metadata_file(self) -> str:
        return os.path.join(os.fspath(self.path), ".metadata")

    def _check_against_metadata(self, dtype: torch.dtype, shape, index) -> None:
        """What the data holds must be what .metadata says it is (dtype, chunk size): a
        changed .metadata would otherwise load other values into the right places."""
        offsets = tuple(index.offset or ())
        chunk = getattr(self, "_chunks", {}).get((index.fqn, offsets))
        if chunk is None:
            raise CheckpointError(f"{self._metadata_file()}: no chunk of '{index.fqn}' at {offsets}")
        if dtype != chunk[0] or list(shape) != list(chunk[1]):
            raise CheckpointError(
                f"{self._metadata_file()}: says '{index.fqn}' at {offsets} is {chunk[0]} {chunk[1]}, but its data "
                f"is {dtype} {tuple(shape)}")

    def _read_entry(self, f, relative_path: str, index, items: List, planner, lock, scratch: "_Scratch") -> None:
        """One stored entry: read, checked, loaded once, and copied to each of `items`
        (or read straight into the one destination it fills: _stream_entry)."""
        info = self.storage_data[index]
        where = os.path.join(os.fspath(self.path), relative_path)
        check = (self._verification.entry_check(relative_path, index.fqn, info.offset, info.length)
                 if self._verification is not None else EntryCheck(None, True))
        if check is None:
            return  # recorded, and refused on every rank before anything is loaded
        targets = self._direct_targets(index, items, planner, lock, info.length)

        def commit(item, dest) -> None:
            with lock or contextlib.nullcontext():
                planner.commit_tensor(item, dest)

        if targets is not None and self._stream_entry(f, relative_path, where, index, info, check, targets, scratch,
                                                      commit):
            return
        view = scratch.entry(info.length)
        hasher = hashlib.sha256() if check.sha256 is not None else None
        got = _read_into(f, info.offset, view, hasher)
        if got != info.length:
            raise ValueError(f"the file ends {info.length - got} bytes before entry '{index.fqn}' "
                             f"(at bytes {info.offset}-{info.offset + info.length} per .metadata)")
        if hasher is not None and not self._verification.digest_matches(
                relative_path, index.fqn, info.offset, info.length, got, hasher.hexdigest(), check.sha256):
            return
        try:
            layout = tensor_entry.layout_of(view)
        except tensor_entry.NotPlain:
            layout = None
        if check.zip_crc:
            if layout is None:  # an archive of another layout: zipfile reads it
                problem = zip_crc_problem(view, index.fqn)
            else:
                problem = tensor_entry.crc_problem(list(layout[1].values()), lambda p: view[p.start:p.start + p.size],
                                                   index.fqn)
            if problem is not None:
                self._refuse(relative_path, problem)
                return
        tensor = None
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                with lock or contextlib.nullcontext():
                    planner.load_bytes(item, io.BytesIO(bytes(view)))
                continue
            if tensor is None:
                tensor = self._tensor_of(view, scratch.buffer, layout, f"{where} (entry '{index.fqn}')", index.fqn)
                self._check_against_metadata(tensor.dtype, tensor.shape, index)
            source = tensor
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, start, length)
            with lock or contextlib.nullcontext():
                dest = planner.resolve_tensor(item).detach()
            if dest.size() != source.size():
                raise ValueError(f"entry '{index.fqn}': a chunk of {tuple(source.size())} for a target of "
                                 f"{tuple(dest.size())}")
            dest.copy_(source)
            with lock or contextlib.nullcontext():
                planner.commit_tensor(item, dest)

    def _refuse(self, relative_path: str, problem: str) -> None:
        if self._verification is None:
            raise ValueError(problem)
        self._verification.refuse_entry(relative_path, problem)

    @staticmethod
    def _tensor_of(view, buffer, layout, where: str, key: str) -> torch.Tensor:
        """The tensor of the entry `view` (checked bytes; a view of `buffer` from its
        start): a view of the storage's bytes where they are when the entry is of the
        plain form, else torch.load's (weights-only) of them."""
        if layout is not None:
            roles, places = layout

            def member(m):
                place = places[m.name]
                return view[place.start:place.start + place.size]

            try:
                record = tensor_entry.read_record(roles, member, where)
                storage = roles.storages.get(record.key)
                if storage is None:
                    raise ValueError(f"its data.pkl names storage '{record.key}', which it does not hold")
                if storage.size != record.storage_bytes:
                    raise ValueError(f"storage '{record.key}' has {storage.size} bytes, its data.pkl says "
                                     f"{record.storage_bytes}")
                return record.tensor_over(buffer, places[storage.name].start)
            except tensor_entry.NotPlain:
                pass  # safe, of another form: torch.load reads it
            except ValueError as e:
                raise ValueError(f"entry '{key}': {e}") from e
        tensor = torch.load(io.BytesIO(bytes(view)), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"entry '{key}' holds a {type(tensor).__name__}, not a tensor")
        return tensor

    def _direct_targets(self, index, items: List, planner, lock, length: int) -> Optional[List["_Target"]]:
        """Where each item of entry `index` goes, if the entry's storage bytes may be read
        straight into the destinations: every item a contiguous range of the chunk's
        row-major elements, going to a fresh (the planner says so), contiguous tensor of
        the chunk's dtype; the entry large enough to be worth it. In storage order."""
        if length < _STREAM_MIN_BYTES or not getattr(planner, "fills_fresh_tensors", False):
            return None
        chunk = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if chunk is None or any(item.type == LoadItemType.BYTE_IO for item in items):
            return None
        dtype, sizes = chunk
        targets: List[_Target] = []
        for item in items:
            start = _contiguous_range(sizes, item.storage_offsets, item.lengths)
            if start is None:
                return None
            with lock or contextlib.nullcontext():
                dest = planner.resolve_tensor(item).detach()
            if (dest.dtype != dtype or list(dest.shape) != list(item.lengths) or not dest.is_contiguous()
                    or dest.device.type not in ("cpu", "cuda") or dest.is_conj() or dest.is_neg()):
                return None
            targets.append(_Target(start * dtype.itemsize, dest.numel() * dtype.itemsize, item, dest))
        targets.sort(key=lambda t: t.start)
        if any(a.start + a.size > b.start for a, b in zip(targets, targets[1:])):
            return None
        return targets

    def _stream_entry(self, f, relative_path: str, where: str, index, info, check: EntryCheck,
                      targets: List["_Target"], scratch: "_Scratch", commit) -> bool:
        """Read entry `index` with the ranges of its storage's bytes that `targets` take
        going straight into their fresh destinations (the rest through a scratch block),
        hashing and CRC-checking every byte block by block as it arrives, the small
        members beside them. False, with nothing checked or recorded, where the entry is
        not of the plain form that allows it (the caller reads it whole). True once it is
        loaded, or found to differ (recorded; the destinations then hold bytes nobody
        will load)."""
        length = info.length
        tail_size = min(length, _TAIL_BYTES)
        tail = _pread(f, info.offset + length - tail_size, tail_size)
        if len(tail) != tail_size:
            return False
        dtype, sizes = self._chunks[(index.fqn, tuple(index.offset or ()))]
        try:
            directory = tensor_entry.read_directory(tail, length - tail_size, length)
            roles = tensor_entry.roles(directory)
            if len(roles.storages) != 1:
                return False
            (key, storage), = roles.storages.items()
            head = _pread(f, info.offset, min(length, storage.header + _HEADER_SLACK))
            data = tensor_entry.locate(storage, head, 0)
            data_end = data.start + data.size
            if data.start > len(head) or data_end > directory.start:
                return False
            if data_end < length - tail_size:
                tail = _pread(f, info.offset + data_end, length - tail_size - data_end) + tail
                if len(tail) != length - data_end:
                    return False
            else:
                tail = tail[data_end - (length - tail_size):]
            places = []
            for member in directory.members:  # every other member lies before or after the storage
                if member is storage:
                    continue
                place = (tensor_entry.locate(member, head[:data.start], 0) if member.header < data.start
                         else tensor_entry.locate(member, tail, data_end))
                if not (place.start + place.size <= data.start
                        or data_end <= place.start and place.start + place.size <= directory.start):
                    return False
                places.append(place)
            by_name = {p.name: p for p in places}

            def bytes_of(place):
                if place.start < data.start:
                    return head[place.start:place.start + place.size]
                return tail[place.start - data_end:place.start - data_end + place.size]

            record = tensor_entry.read_record(roles, lambda m: bytes_of(by_name[m.name]), where)
        except (tensor_entry.NotPlain, CheckpointError, ValueError, KeyError, struct.error):
            return False  # read whole, checked first: what is wrong is then reported as such
        if (record.key != key or record.dtype != dtype or list(record.size) != list(sizes)
                or not record.is_dense() or record.storage_bytes != data.size
                or targets[-1].start + targets[-1].size > data.size):
            return False
        hasher = hashlib.sha256() if check.sha256 is not None else None
        if hasher is not None:
            hasher.update(head[:data.start])
        data_crc = scratch.stream(f, info.offset + data.start, data.size, targets, hasher)
        if data_crc is None:
            raise ValueError(f"the file ends inside entry '{index.fqn}' (at bytes {info.offset}-"
                             f"{info.offset + length} per .metadata)")
        if hasher is not None:
            hasher.update(tail)
            if not self._verification.digest_matches(relative_path, index.fqn, info.offset, length, length,
                                                     hasher.hexdigest(), check.sha256):
                return True
        if check.zip_crc:
            problem = tensor_entry.crc_problem([data] + places, bytes_of, index.fqn, known={data.name: data_crc})
            if problem is not None:
                self._refuse(relative_path, problem)
                return True
        for target in targets:
            commit(target.item, target.dest)
        return True


class _Target(NamedTuple):
    """A range of an entry's storage bytes (start, size) and the fresh, contiguous tensor
    of the read item that takes it."""
    start: int
    size: int
    item: Any
    dest: torch.Tensor


def _contiguous_range(sizes, offsets, lengths) -> Optional[int]:
    """The first element (row-major) of the box (offsets, lengths) of a tensor of
    `sizes`, if the box's elements are one contiguous run of its elements; else None."""
    if len(sizes) != len(offsets) or len(sizes) != len(lengths):
        return None
    outer = next((d for d, n in enumerate(lengths) if n != 1), len(sizes))
    if any(lengths[d] != sizes[d] for d in range(outer + 1, len(sizes))):
        return None
    start, step = 0, 1
    for d in reversed(range(len(sizes))):
        start += offsets[d] * step
        step *= sizes[d]
    return start


_STREAM_MIN_BYTES = 1 << 20  # smaller entries are read whole: one read, one copy
_TAIL_BYTES = 1 << 13  # read first from an entry's end: its zip directory
_HEADER_SLACK = 1 << 10  # bytes read past a storage's local header: its name and padding
_BLOCK_BYTES = 4 << 20  # hashed and CRC-checked right after reading, while in cache
_PINNED_SLOTS = 3  # per reading thread, for CUDA destinations


def _pread(f, position: int, size: int) -> bytes:
    f.seek(position)
    return f.read(size)


def _read_into(f, position: int, view, hasher) -> int:
    """Read len(view) bytes from `position` into `view`, block by block, each hashed
    right after it arrives; the number of bytes read (less at the end of the file)."""
    f.seek(position)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:got + _BLOCK_BYTES])
        if not n:
            break
        if hasher is not None:
            hasher.update(view[got:got + n])
        got += n
    return got


class _Scratch:
    """One reading thread's buffers, reused from entry to entry: the bytes of an entry
    read whole, and for CUDA destinations a few page-locked blocks that the storage's
    bytes pass through on their way to the GPU (each block's copy runs while the next
    is read)."""

    def __init__(self):
        self.buffer = bytearray(0)
        self._pinned: List[torch.Tensor] = []
        self._views: List[memoryview] = []
        self._copies: List[Optional[Any]] = []
        self._next = 0

    def entry(self, size: int) -> memoryview:
        """A writable view of `size` bytes at the start of the thread's buffer."""
        if len(self.buffer) < size:
            self.buffer = bytearray(size)  # a new one: tensors made over the old may live on
        return memoryview(self.buffer)[:size]

    def stream(self, f, position: int, total: int, targets: List[_Target], hasher) -> Optional[int]:
        """Read the `total` storage bytes at `position`: the ranges `targets` take into
        their destinations (on the CPU straight into their memory, on CUDA through the
        page-locked blocks), the rest into a scratch block; each block hashed and its
        CRC-32 taken while it is in cache. The CRC-32 of them all, or None where the
        file ends first."""
        segments = []  # (start, size, destination bytes or None), tiling [0, total)
        at = 0
        for target in targets:
            if target.start > at:
                segments.append((at, target.start - at, None))
            segments.append((target.start, target.size, tensor_entry.byte_view(target.dest)))
            at = target.start + target.size
        if at < total:
            segments.append((at, total - at, None))
        f.seek(position)
        crc = 0
        for start, size, raw in segments:
            on_cuda = raw is not None and raw.device.type == "cuda"
            memory = memoryview(raw.numpy()) if raw is not None and not on_cuda else None
            done = 0
            while done < size:
                n = min(_BLOCK_BYTES, size - done)
                if on_cuda:
                    slot = self._slot(raw.device)
                    view = self._views[slot][:n]
                elif memory is not None:
                    view = memory[done:done + n]
                else:
                    view = self.entry(_BLOCK_BYTES)[:n]
                got = 0
                while got < n:
                    read = f.readinto(view[got:])
                    if not read:
                        return None
                    got += read
                if hasher is not None:
                    hasher.update(view)
                crc = zlib.crc32(view, crc)
                if on_cuda:
                    raw[done:done + n].copy_(self._pinned[slot][:n], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(torch.cuda.current_stream(raw.device))
                    self._copies[slot] = copied
                done += n
        return crc

    def _slot(self, device) -> int:
        """A page-locked block no copy is still reading from."""
        if not self._pinned:
            with torch.cuda.device(device):
                self._pinned = [torch.empty(_BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
                                for _ in range(_PINNED_SLOTS)]
            self._views = [memoryview(t.numpy()) for t in self._pinned]
            self._copies = [None] * _PINNED_SLOTS
        slot = self._next
        self._next = (slot + 1) % len(self._pinned)
        if self._copies[slot] is not None:
            self._copies[slot].synchronize()
            self._copies[slot] = None
        return slot

    def finish(self) -> None:
        """Wait for the copies still reading from the blocks (before they are reused)."""
        for done in self._copies:
            if done is not None:
                done.synchronize()
        self._copies = [None] * len(self._copies)


def _runs(per_file: Dict[str, List], size, threads: int) -> List[Tuple[str, List]]:
    """Each file's entries (in file order) cut into runs of consecutive entries, as many
    runs in all as `threads` can read at once where the files are fewer: (file, entries)
    per run, the largest first. `size(entry)`: its bytes."""
    total = sum(size(e) for entries in per_file.values() for e in entries)
    target = max(1, -(-total // threads))
    runs: List[Tuple[int, str, List]] = []
    for name, entries in per_file.items():
        run: List = []
        bytes_in_run = 0
        for entry in entries:
            if run and bytes_in_run + size(entry) > target:
                runs.append((bytes_in_run, name, run))
                run, bytes_in_run = [], 0
            run.append(entry)
            bytes_in_run += size(entry)
        if run:
            runs.append((bytes_in_run, name, run))
    runs.sort(key=lambda r: -r[0])
    return [(name, run) for _, name, run in runs]


def load_weights_only(value: io.BytesIO, where: str):
    """A value DCP stored as bytes (a torch.save), loaded weights-only."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{where}: refused or unreadable value ({type(e).__name__}: {first})") from e


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with values stored as bytes loaded weights-only (torch's
    own loads them with weights_only=False) and a failure naming the file. Its lookups
    and the values it sets are by key: several reader threads may call it at once."""

    reads_concurrently = True

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
        loaded = load_weights_only(value, f"{getattr(info, 'relative_path', '?')} (entry '{fqn}', where .metadata "
                                          "places it)")
        if self.flatten_state_dict:
            node, path = self.original_state_dict, self.mappings[fqn]
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = loaded
        else:
            self.state_dict[fqn] = loaded


def encode_json(value) -> str:
    """Our metadata as JSON text; tuples and 0-d tensors kept apart from lists and numbers."""
    return json.dumps(_to_json(value), sort_keys=True)


def decode_json(text, what: str):
    if not isinstance(text, str):
        raise CheckpointError(f"{what}: expected JSON text, found {type(text).__name__}")
    try:
        return _from_json(json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{what}: unreadable JSON ({e})") from e


def _to_json(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch."),
                "device": value.device.type}
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _from_json(value):
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            dtype = _torch_value(value["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {value['dtype']!r}")
            return torch.tensor(value["__tensor__"], dtype=dtype)
        return {k: _from_json(v) for k, v in value.items()}
    return value


def encode_object(value, what: str) -> bytes:
    """`value` (module extra state) as the bytes of a torch.save that loads weights-only;
    anything that would not load so (arbitrary objects) is refused here, at save."""
    buf = io.BytesIO()
    torch.save(value, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise TypeError(
            f"{what}: holds a {type(value).__name__} that cannot be loaded without running code from the file "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); keep extra state to tensors, numbers, "
            "strings and containers of them, or allow its classes with torch.serialization.add_safe_globals") from e
    return data


def decode_object(data, what: str):
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointError(f"{what}: expected saved bytes, found {type(data).__name__}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{what}: refused or unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e


class _NoClassUnpickler(pickle.Unpickler):
    """Builtin values only (dicts, lists, tuples, strings, numbers, bytes): any class in
    the stream is refused by `refusal(module, name)`."""

    def __init__(self, file, refusal):
        super().__init__(file)
        self.refusal = refusal

    def find_class(self, module, name):
        raise self.refusal(module, name)


def load_plain_pickle(file, what: str):
    """A pickle of builtin values (e.g. a CUDA memory snapshot) loaded without admitting
    any class: loading runs nothing from the file."""
    return _NoClassUnpickler(file, lambda module, name: ValueError(
        f"{what}: names class {module}.{name}; only builtin values are loaded (nothing from a file runs)")).load()


def decode_legacy_pickle(data, what: str):
    """Metadata of checkpoints written before it was JSON (pickled builtins only: dicts,
    lists, tuples, strings, numbers) decoded without admitting any class; a pickle that
    names a class is refused with how to convert the checkpoint."""

    def refusal(module, name):
        return CheckpointError(
            f"{what}: this checkpoint's metadata was written by an earlier megatron_fsdp_ext as a pickle that "
            f"names {module}.{name}; loading it could run code, so nothing was loaded. If you trust its source, "
            "convert it once: load it with the megatron_fsdp_ext version that wrote it and save it again with "
            "this one (save_checkpoint now writes JSON metadata and weights-only extra state)")

    try:
        return _NoClassUnpickler(io.BytesIO(bytes(data)), refusal).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{what}: unreadable ({type(e).__name__}: {e})") from e
