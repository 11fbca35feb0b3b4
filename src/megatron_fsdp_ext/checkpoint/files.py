"""Atomic, verified checkpoint directories: the file handling behind dcp.save_checkpoint
and dcp.load_checkpoint, independent of what the checkpoint holds.

What it guarantees:

* all ranks agree on the path: different paths on different ranks are refused on every
  rank before anything is read or written (check_same_path);
* a save publishes by rename only after every rank succeeded: the ranks write into a
  fresh sibling directory, and rank 0 renames it into place (publish) only once every
  rank's write and hashing has succeeded; until then the previous checkpoint is untouched;
* a manifest (MANIFEST_NAME), written last, is the completeness marker: a directory
  without it is an incomplete save. It lists every file with its size; .metadata with its
  sha256, each data file with the sha256 of each byte range DCP stored an entry in
  (offset, length), the ranges tiling the file exactly (entry_ranges: gaps get ranges of
  their own), each hashed by the rank that wrote the file in one pass (digest_ranges);
* loads verify every byte that reaches the model: .metadata is hashed by every rank
  before it is parsed; every storage entry .metadata names must be a range the manifest
  lists (check_covered); each data file's size and ranges are checked by one rank
  (Verification.start), and the reader hashes each entry's bytes as it reads them, and
  checks the zip CRC-32 of every member, before it loads them (Verification.entry_check,
  check_entry); nothing is loaded before every rank's findings are agreed
  on. Manifests of version 1 (one sha256 per file) are verified as then: each file hashed
  whole by one rank on a thread while the load reads (verify_share);
* every failure is agreed on and raised on every rank (agree.raise_agreed), naming the ranks;
* temporary directories a killed save left are removed by the next save (remove_stale_temporaries).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import threading
import warnings
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection, Dict, Iterable, List, NamedTuple, Optional, Tuple, TypeVar

from ..core.agree import Agreement, describe, gather_objects, raise_agreed

MANIFEST_NAME = "mfsdp_manifest.json"
MANIFEST_FORMAT = "megatron_fsdp_ext.sharded_checkpoint"
MANIFEST_VERSION = 2
_OWN_FILES = re.compile(r"^(\.metadata|\.metadata\.tmp|__\d+_\d+\.distcp|" + re.escape(MANIFEST_NAME) + r"(\.part)?)$")
WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_BLOCK = 8 << 20  # bytes read at a time when hashing a file's ranges
_T = TypeVar("_T")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted or not ours, or a save that failed."""


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


def whole_file_record(path: str) -> dict:
    """A manifest record of the file at `path` hashed whole (what .metadata gets)."""
    digest, size = file_digest(path)
    return {"sha256": digest, "size": size}


def _each(fn: Callable[[str], _T], names: List[str], threads: int, prefix: str) -> List[_T]:
    """fn of every name, `threads` at a time (hashlib releases the GIL: files hash in parallel)."""
    if threads <= 1 or len(names) <= 1:
        return [fn(n) for n in names]
    with ThreadPoolExecutor(max_workers=min(threads, len(names)), thread_name_prefix=prefix) as pool:
        return list(pool.map(fn, names))


def entry_ranges(name: str, size: int, entries: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The byte ranges (offset, length) a manifest lists for data file `name` of `size`
    bytes: the entries DCP stored in it (a range several entries share, once), and every
    gap before, between or after them as a range of its own, so that the ranges tile the
    file exactly. Entries that overlap, or end past the end of the file, are a ValueError
    naming the file."""
    out: List[Tuple[int, int]] = []
    cursor = 0
    for offset, length in sorted(set(entries)):
        if offset < cursor:
            raise ValueError(f"'{name}': the entry at bytes {offset}-{offset + length} overlaps the one before it, "
                             f"which ends at byte {cursor}")
        if offset > cursor:
            out.append((cursor, offset - cursor))
        out.append((offset, length))
        cursor = offset + length
    if cursor > size:
        raise ValueError(f"'{name}' has {size} bytes, but an entry ends at byte {cursor}")
    if cursor < size:
        out.append((cursor, size - cursor))
    return out


def digest_ranges(path: str, ranges: List[Tuple[int, int]]) -> List[list]:
    """[offset, length, sha256] of each range of the file at `path`, in one pass over its
    bytes (the ranges are entry_ranges': in order, tiling the file)."""
    out: List[list] = []
    buffer = memoryview(bytearray(max(1, min(_HASH_BLOCK, max((n for _, n in ranges), default=0)))))
    with open(path, "rb", buffering=0) as f:
        for offset, length in ranges:
            f.seek(offset)
            hasher = hashlib.sha256()
            left = length
            while left:
                got = f.readinto(buffer[:min(left, len(buffer))])
                if not got:
                    raise ValueError(f"'{os.path.basename(path)}' ends before byte {offset + length}")
                hasher.update(buffer[:got])
                left -= got
            out.append([offset, length, hasher.hexdigest()])
    return out


def data_file_records(directory: str, entries: Dict[str, List[Tuple[int, int]]], threads: int) -> Dict[str, dict]:
    """Manifest records of the data files `entries` names (file -> the (offset, length) of
    every entry DCP wrote into it): size, and the sha256 of every range of entry_ranges;
    `threads` files at a time."""
    def record(name: str) -> dict:
        where = os.path.join(directory, name)
        size = os.path.getsize(where)
        return {"size": size, "entries": digest_ranges(where, entry_ranges(name, size, entries[name]))}

    names = sorted(entries)
    return dict(zip(names, _each(record, names, threads, "mfsdp-hash")))


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


def publish(target: str, tmp: str, token: str, files: Dict[str, dict], world: int) -> None:
    """Rank 0: write the manifest (the completeness marker; `files`: every file's record,
    whole_file_record or data_file_records) into `tmp`, then swap `tmp` in for `target`.
    Until the second rename, `target` is the previous checkpoint."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "world_size": world,
        "files": dict(sorted(files.items())),
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


def remove_stale_temporaries(target: str, in_use: Collection[str] = ()) -> List[str]:
    """Rank 0, before a save: remove the temporary sibling directories
    (.<name>.mfsdp-tmp-<token>) that saves killed mid-write left next to `target`,
    except those in `in_use` (saves of this process still writing). Directories a swap
    moved aside (.<name>.mfsdp-old-*) may hold the only copy of the previous checkpoint
    and are never removed. Returns what was removed."""
    head, name = os.path.split(target)
    prefix = f".{name}.mfsdp-tmp-"
    try:
        found = sorted(n for n in os.listdir(head) if n.startswith(prefix))
    except OSError:
        return []
    keep = {os.path.abspath(p) for p in in_use}
    removed = []
    for entry in found:
        where = os.path.join(head, entry)
        if where in keep or os.path.islink(where) or not os.path.isdir(where):
            continue
        shutil.rmtree(where, ignore_errors=True)
        removed.append(where)
    return removed


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
    for name, record in manifest["files"].items():
        problem = _record_problem(record)
        if problem is not None:
            raise CheckpointError(f"load_checkpoint({path}): {where}: the record of '{name}' {problem}: the manifest "
                                  "is corrupted or was modified after the save; nothing was loaded")
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _record_problem(record) -> Optional[str]:
    """What is wrong with one file's manifest record, if anything: a size, and either a
    sha256 of the whole file or [offset, length, sha256] ranges that tile it exactly."""
    if not isinstance(record, dict) or not _is_count(record.get("size")):
        return "gives no size"
    if "entries" not in record:
        return None if isinstance(record.get("sha256"), str) else "gives neither a sha256 nor ranges"
    ranges = record["entries"]
    if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 3 and _is_count(r[0]) and _is_count(r[1])
            and isinstance(r[2], str) and _SHA256.match(r[2]) for r in ranges):
        return "lists ranges that are not [offset, length, sha256]"
    cursor = 0
    for offset, length, _ in ranges:
        if offset != cursor:
            return (f"lists ranges that do not tile the file: one starts at byte {offset}, the one before ends at "
                    f"{cursor}")
        cursor += length
    if cursor != record["size"]:
        return f"lists ranges that end at byte {cursor}, but gives a size of {record['size']} bytes"
    return None


def check_zip_crc(data: bytes, what: str) -> None:
    """Every member of a torch.save archive (one DCP entry, `data`) matches its CRC-32,
    which torch.load does not check. Stored members (torch.save does not compress) are
    checked in place, without zipfile's copies."""
    view = memoryview(data)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    with archive.open(info) as member:  # zipfile checks the CRC as it reads
                        member.read()
                    continue
                header = bytes(view[info.header_offset:info.header_offset + ZIP_LOCAL_HEADER.size])
                if len(header) != ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"no local header for member '{info.filename}'")
                name_length, extra_length = ZIP_LOCAL_HEADER.unpack(header)[-2:]
                start = info.header_offset + ZIP_LOCAL_HEADER.size + name_length + extra_length
                member = view[start:start + info.compress_size]
                if len(member) != info.compress_size or zlib.crc32(member) != info.CRC:
                    raise ValueError(f"entry '{what}': member '{info.filename}' fails its CRC-32 check (the bytes "
                                     "changed after writing)")
    except zipfile.BadZipFile as e:
        raise ValueError(f"entry '{what}' is not a readable torch.save archive ({e})") from e


# A zip local file header: signature, versions and flags, sizes, name and extra lengths.
ZIP_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


def zip_crc_problem(data, key: str) -> Optional[str]:
    """check_zip_crc of entry `key` (its bytes `data`), as one line, if it fails."""
    try:
        check_zip_crc(bytes(data), key)
    except Exception as e:  # garbled bytes fail in many ways (an unknown compression method, ...)
        return str(e) if isinstance(e, ValueError) else f"entry '{key}' is unreadable ({type(e).__name__}: {e})"
    return None


def _crc_problem(name: str, key: str, data: bytes) -> Optional[str]:
    """zip_crc_problem of one entry of file `name`, naming the file."""
    problem = zip_crc_problem(data, key)
    return None if problem is None else f"'{name}': {problem}"


def _check_file(target: str, name: str, expected: dict, entries: List[Tuple[int, int, str]]) -> Optional[str]:
    """One file against its manifest entry (sha256, size), then every entry stored in it
    plainly (`entries`: offset, length, key) against its zip CRC-32; what differs, if
    anything, as one line."""
    where = os.path.join(target, name)
    if not os.path.isfile(where):
        return f"'{name}' is listed in the manifest but missing"
    digest, size = file_digest(where)
    if digest != expected.get("sha256") or size != expected.get("size"):
        return (f"'{name}' has sha256 {digest} ({size} bytes), the manifest expects {expected.get('sha256')} "
                f"({expected.get('size')} bytes)")
    with open(where, "rb") as f:
        for offset, length, key in entries:
            f.seek(offset)
            data = f.read(length)
            if len(data) != length:
                return f"'{name}': entry '{key}' at bytes {offset}-{offset + length} ends past the end of the file"
            problem = _crc_problem(name, key, data)
            if problem is not None:
                return problem
    return None


def verify_share(target: str, manifest: dict, rank: int, world: int, names: Optional[List[str]] = None,
                 threads: int = 1, entries: Optional[Dict[str, List[Tuple[int, int, str]]]] = None) -> List[str]:
    """Check this rank's share of the manifest's files (of `names`, default all; every
    world-th in sorted order): sha256 and size, and the CRC-32 of the entries `entries`
    lists per file. What differs, one line per file."""
    mine = [n for i, n in enumerate(sorted(manifest["files"] if names is None else names)) if i % world == rank]
    entries = entries or {}

    def check(name: str) -> Optional[str]:
        return _check_file(target, name, manifest["files"][name], entries.get(name, []))

    return [line for line in _each(check, mine, threads, "mfsdp-verify") if line is not None]


def _plain_entries(metadata) -> Dict[str, List[Tuple[int, int, str]]]:
    """Per data file, the entries DCP stored in it without a transform: (offset, length, key)."""
    out: Dict[str, List[Tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if not getattr(info, "transform_descriptors", None):
            out.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for found in out.values():
        found.sort()
    return out


def refuse_corrupted(what: str, shared: Dict[int, List[str]]) -> None:
    """Every rank's lines of what differs from the manifest (by rank): refused if any."""
    bad = list(dict.fromkeys(line for lines in shared.values() for line in lines))  # ranks may find the same
    if bad:
        more = f"; and {len(bad) - 1} more: {bad[1:4]}" if len(bad) > 1 else ""
        raise CheckpointError(f"{what}: the checkpoint is corrupted (checked against {MANIFEST_NAME}); nothing "
                              f"was loaded: {bad[0]}{more}")


class EntryCheck(NamedTuple):
    sha256: Optional[str]  # what the entry's bytes must hash to; None: not hashed by the reader
    zip_crc: bool  # the reader checks the CRC-32 of the entry's zip members


class Verification:
    """A load's check of every byte it loads; nothing reaches the model before corrupted()
    has been agreed on (read_stage()), and an earlier stage that fails waits for the
    checks too (stage()), so a corrupted file outranks the error it caused.

    The small .metadata is hashed by every rank at once (it is read next). Then (start())
    the data files are shared among the ranks for the checks of whole files: with ranges
    in the manifest (version 2), each file's size; with one sha256 per file (version 1),
    its sha256 and the zip CRC-32 of every entry, on a thread while the load reads. The
    entries of version-2 files are checked as they are read (check_entry): the reader
    hashes each one's bytes right after reading them, and loads them only if they match
    the manifest's range and every zip member matches its CRC-32 (which catches bytes that
    changed before the manifest was computed over them); a mismatch is recorded, naming
    the file and the entry. Without a manifest (verify=False) check_entry checks the CRC
    alone and raises."""

    def __init__(self, what: str, target: str, manifest: Optional[dict], rank: int, world: int, threads: int):
        self.what, self.target, self.manifest = what, target, manifest
        self.rank, self.world, self.threads = rank, world, threads
        self.metadata_bad: List[str] = []
        self._bad: List[str] = []  # the thread's (whole files)
        self._found: List[str] = []  # sizes and entries, found on this rank's threads
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._ranges: Dict[str, Dict[Tuple[int, int], str]] = {}
        if manifest is not None:
            self._ranges = {name: {(offset, length): digest for offset, length, digest in record["entries"]}
                            for name, record in manifest["files"].items() if "entries" in record}
            if ".metadata" in manifest["files"]:
                self.metadata_bad = verify_share(target, manifest, 0, 1, names=[".metadata"])

    def start(self, metadata) -> None:
        """Check this rank's share of the data files: the sizes of those with ranges, now;
        those hashed whole, on a thread (`metadata`: the checkpoint's, which says where
        each entry is)."""
        if self.manifest is None:
            return
        data = sorted(n for n in self.manifest["files"] if n != ".metadata")
        for name in data[self.rank::self.world]:
            if name in self._ranges:
                self._check_size(name)
        whole = [n for n in data if n not in self._ranges]
        if not whole:
            return
        entries = _plain_entries(metadata)

        def run() -> None:
            try:
                self._bad = verify_share(self.target, self.manifest, self.rank, self.world, names=whole,
                                         threads=self.threads, entries=entries)
            except BaseException as e:  # reported by corrupted(), on the load's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="mfsdp-verify", daemon=True)
        self._thread.start()

    def _check_size(self, name: str) -> None:
        where = os.path.join(self.target, name)
        expected = self.manifest["files"][name]["size"]
        if not os.path.isfile(where):
            self._record(f"'{name}' is listed in the manifest but missing")
        elif os.path.getsize(where) != expected:
            self._record(f"'{name}' has {os.path.getsize(where)} bytes, the manifest expects {expected}")

    def _record(self, line: str) -> None:
        with self._lock:
            self._found.append(line)

    def entry_check(self, name: str, key: str, offset: int, length: int) -> Optional[EntryCheck]:
        """How the reader checks the bytes of entry `key`, at bytes offset..offset+length
        of data file `name`, before it loads them: the sha256 they must have (ranges in
        the manifest) or None (no manifest; a file hashed whole on the thread), and whether
        the zip CRC-32 of their members is checked here (not for a file the thread checks
        whole). None: the entry is not to be read (a file or range the manifest does not
        list; recorded)."""
        if self.manifest is None:
            return EntryCheck(None, True)
        ranges = self._ranges.get(name)
        if ranges is None:
            if name in self.manifest["files"]:
                return EntryCheck(None, False)
            self._record(f"'{name}' is not listed in the manifest")
            return None
        expected = ranges.get((offset, length))
        if expected is None:
            self._record(f"'{name}': entry '{key}' at bytes {offset}-{offset + length} is not a range the manifest "
                         "lists")
            return None
        return EntryCheck(expected, True)

    def digest_matches(self, name: str, key: str, offset: int, length: int, got: int, digest: str,
                       expected: str) -> bool:
        """Whether the sha256 `digest` of the `got` bytes read of an entry (entry_check)
        is the `expected` one; what differs is recorded."""
        if got == length and digest == expected:
            return True
        self._record(f"'{name}' has sha256 {digest} at bytes {offset}-{offset + got} (entry '{key}'), the manifest "
                     f"expects {expected} for bytes {offset}-{offset + length}")
        return False

    def refuse_entry(self, name: str, problem: str) -> None:
        """Entry bytes of data file `name` failed a check (`problem`, naming the entry):
        recorded against the manifest, or, without one, raised as a ValueError."""
        if self.manifest is None:
            raise ValueError(problem)
        self._record(f"'{name}': {problem}")

    def check_entry(self, name: str, key: str, offset: int, length: int, data: bytes,
                    zip_members: bool = True) -> bool:
        """Whether the bytes `data` of entry `key`, read from bytes offset..offset+length
        of data file `name`, may be loaded. With ranges in the manifest: their sha256 is
        the manifest's for exactly that range, and (zip_members: a torch.save archive, as
        DCP stores entries without a transform) every member matches its CRC-32; what
        differs is recorded and False returned. A file hashed whole is checked on the
        thread (True). Without a manifest: the CRC-32 check, raising ValueError. Safe
        to call from several threads."""
        check = self.entry_check(name, key, offset, length)
        if check is None:
            return False
        if check.sha256 is not None and not self.digest_matches(name, key, offset, length, len(data),
                                                                hashlib.sha256(data).hexdigest(), check.sha256):
            return False
        if zip_members and check.zip_crc:
            if self.manifest is None:
                check_zip_crc(data, key)
                return True
            problem = _crc_problem(name, key, data)
            if problem is not None:
                self._record(problem)
                return False
        return True

    def corrupted(self) -> List[str]:
        """This rank's findings of what differs from the manifest (waits for the thread's
        hashes); a file the thread could not read counts as corrupted: nothing vouches
        for it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            return [f"hashing this rank's share of the files failed ({describe(self._error)})"]
        with self._lock:
            return self._bad + list(dict.fromkeys(self._found))

    def refuse(self, shared: Dict[int, List[str]], _group=None) -> None:
        refuse_corrupted(self.what, shared)

    def stage(self) -> Agreement:
        """An Agreement for a stage before the values are read: a failure on any rank
        first waits for every rank's hashes, and a corrupted file outranks it."""
        def corruption_first(failed: Dict[int, str], own: Optional[BaseException]) -> None:
            self.refuse(gather_objects(self.corrupted()))
            raise_agreed(self.what, own, [failed], error=CheckpointError)

        return Agreement(self.what, error=CheckpointError, fail=corruption_first)

    def read_stage(self) -> Agreement:
        """The Agreement of the stage that reads the values: every rank's findings shared,
        a corrupted file refused before anything is loaded (and before the stage's own
        failures)."""
        return Agreement(self.what, error=CheckpointError, share=self.corrupted, check=self.refuse)


def check_covered(path: str, meta, manifest: dict) -> None:
    """Every file DCP would read is one the manifest vouches for, and every entry
    .metadata places in a file with ranges in the manifest is exactly one of those ranges
    (so that the reader can check each entry it reads against its own sha256)."""
    files = manifest["files"]
    storage = meta.storage_data or {}
    needed = {".metadata"} | {getattr(s, "relative_path", None) for s in storage.values()}
    unlisted = sorted(n for n in needed - set(files) if n is not None)
    if unlisted:
        raise CheckpointError(f"load_checkpoint({path}): its .metadata points at {unlisted[:5]}, which its manifest "
                              "does not list: it is corrupted or was modified after the save; nothing was loaded")
    ranges = {name: {(offset, length) for offset, length, _ in record["entries"]}
              for name, record in files.items() if "entries" in record}
    for index, info in storage.items():
        listed = ranges.get(info.relative_path)
        if listed is not None and (info.offset, info.length) not in listed:
            raise CheckpointError(
                f"load_checkpoint({path}): its .metadata places '{index.fqn}' at bytes {info.offset}-"
                f"{info.offset + info.length} of '{info.relative_path}', which its manifest does not list as an entry "
                "of that file: .metadata or the manifest was modified after the save; nothing was loaded")
