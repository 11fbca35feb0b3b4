"""One DCP tensor entry read without torch.load.

DCP stores each tensor chunk as a torch.save archive: an uncompressed zip holding
`data.pkl` (the pickled tensor: which storage, its dtype, offset, size and stride),
`byteorder`, the storage's bytes (`data/<key>`) and a few small records. torch.load
copies the storage out of the bytes read and unpickles through a general machine; here
the zip directory is parsed by hand, `data.pkl` through an unpickler that admits only
what torch.save writes for one plain tensor, and the tensor is a view of the bytes where
they already are (or the bytes were read straight into the destination).

Nothing read here runs code: the unpickler's globals are the tensor rebuild functions
(replaced by functions of ours that only check and record their arguments), the storage
classes and dtypes (recorded as dtypes), and OrderedDict; its opcodes are those torch.save
emits. Any other global is a CheckpointError naming the entry. What is safe but not of
the plain form (a conjugate bit, backward hooks, big-endian bytes, compressed or unusual
zip structure) is reported as NotPlain, and the caller loads those bytes with
torch.load(weights_only=True) instead.
"""
from __future__ import annotations

import collections
import io
import math
import pickle
import pickletools
import struct
import sys
import zlib
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .files import ZIP_LOCAL_HEADER, CheckpointError

# Zip records (all little-endian; the local file header is files.py's): central
# directory header, end of central directory, and the zip64 end record and its locator.
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_END64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EXTRA = 0x0001
_STORED = 0
_MAX_PICKLE_BYTES = 1 << 16  # a single tensor's data.pkl is a few hundred bytes

# What torch.save's pickle of one tensor is made of (protocol 2, or a newer one).
_TENSOR_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "GLOBAL", "STACK_GLOBAL", "BINPERSID", "REDUCE", "MARK",
    "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_DICT", "SETITEM", "SETITEMS",
    "BININT", "BININT1", "BININT2", "LONG1", "NONE", "NEWTRUE", "NEWFALSE",
    "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
})


class NotPlain(Exception):
    """The entry is safe to load but not of the plain form read here (torch.load reads it)."""


class Member(NamedTuple):
    name: str
    header: int  # offset of its local header in the archive
    size: int
    crc: int


class Directory(NamedTuple):
    members: List[Member]
    start: int  # where the central directory (and what follows it) starts


class Located(NamedTuple):
    name: str
    start: int  # offset of its bytes in the archive
    size: int
    crc: int


def read_directory(tail, tail_start: int, length: int) -> Directory:
    """The central directory of an archive of `length` bytes whose last bytes, from
    offset `tail_start`, are `tail`. NotPlain where it is not the plain layout torch.save
    writes (no comment, every member stored, the directory inside `tail`)."""
    try:
        return _read_directory(memoryview(tail), tail_start, length)
    except struct.error as e:  # a record cut short
        raise NotPlain(f"a zip record runs past the bytes read ({e})") from e


def _read_directory(tail: memoryview, tail_start: int, length: int) -> Directory:
    end_at = length - _END.size
    if end_at < tail_start:
        raise NotPlain("no end of central directory record")
    sig, disk, cd_disk, _, count, cd_size, cd_start, comment = _END.unpack_from(tail, end_at - tail_start)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk:
        raise NotPlain("no end of central directory record at the end")
    directory_end = end_at
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_start == 0xFFFFFFFF:
        locator_at = end_at - _END64_LOCATOR.size
        if locator_at < tail_start:
            raise NotPlain("no zip64 locator")
        sig, _, end64_at, _ = _END64_LOCATOR.unpack_from(tail, locator_at - tail_start)
        if sig != b"PK\x06\x07" or not tail_start <= end64_at <= locator_at - _END64.size:
            raise NotPlain("no zip64 end record")
        sig, _, _, _, _, _, _, count, cd_size, cd_start = _END64.unpack_from(tail, end64_at - tail_start)
        if sig != b"PK\x06\x06":
            raise NotPlain("no zip64 end record")
        directory_end = end64_at
    if cd_start < tail_start or cd_start + cd_size > directory_end:
        raise NotPlain("the central directory is not where its end record says")
    members: List[Member] = []
    at = cd_start - tail_start
    stop = at + cd_size
    for _ in range(count):
        if at + _CENTRAL.size > stop:
            raise NotPlain("the central directory is cut short")
        (sig, _, _, flags, method, _, _, crc, packed, size, name_length, extra_length, comment_length, _, _, _,
         header) = _CENTRAL.unpack_from(tail, at)
        at += _CENTRAL.size
        if sig != b"PK\x01\x02" or method != _STORED or flags & 1 or at + name_length + extra_length > stop:
            raise NotPlain("a member is compressed, encrypted or garbled")
        name = bytes(tail[at:at + name_length]).decode("utf-8", "replace")
        extra = tail[at + name_length:at + name_length + extra_length]
        at += name_length + extra_length + comment_length
        size, packed, header = _zip64_fields(extra, size, packed, header)
        if packed != size:
            raise NotPlain(f"member '{name}' is not stored as it is")
        members.append(Member(name, header, size, crc))
    if at != stop:
        raise NotPlain("the central directory's size does not match its members")
    return Directory(members, cd_start)


def _zip64_fields(extra, size: int, packed: int, header: int) -> Tuple[int, int, int]:
    """The sizes and header offset of a central directory record, with those it marks
    0xFFFFFFFF taken from its zip64 extra field, in the order zip defines."""
    wanted = [v == 0xFFFFFFFF for v in (size, packed, header)]
    if not any(wanted):
        return size, packed, header
    at = 0
    while at + 4 <= len(extra):
        kind, n = struct.unpack_from("<2H", extra, at)
        if kind == _ZIP64_EXTRA and 8 * sum(wanted) <= n:
            values = iter(struct.unpack_from(f"<{sum(wanted)}Q", extra, at + 4))
            size, packed, header = (next(values) if w else v for w, v in zip(wanted, (size, packed, header)))
            return size, packed, header
        at += 4 + n
    raise NotPlain("a zip64 size without its extra field")


def locate(member: Member, local, local_start: int) -> Located:
    """Where `member`'s bytes are, from its local header inside `local` (the archive's
    bytes from offset `local_start`)."""
    at = member.header - local_start
    if at < 0 or at + ZIP_LOCAL_HEADER.size > len(local):
        raise NotPlain(f"the local header of '{member.name}' is not in the bytes read")
    sig, *_, name_length, extra_length = ZIP_LOCAL_HEADER.unpack_from(local, at)
    if sig != b"PK\x03\x04":
        raise NotPlain(f"no local header for '{member.name}'")
    return Located(member.name, member.header + ZIP_LOCAL_HEADER.size + name_length + extra_length, member.size, member.crc)


class Roles(NamedTuple):
    pickle: Member
    byteorder: Optional[Member]
    storages: Dict[str, Member]  # by storage key
    others: List[Member]


def roles(directory: Directory) -> Roles:
    """Which member is data.pkl, which the byte order, which hold storages: torch.save
    names them <archive>/data.pkl, <archive>/byteorder and <archive>/data/<key>."""
    found_pickle, byteorder, storages, others = None, None, {}, []
    for member in directory.members:
        parts = member.name.split("/")
        if len(parts) == 2 and parts[1] == "data.pkl" and found_pickle is None:
            found_pickle = member
        elif len(parts) == 2 and parts[1] == "byteorder" and byteorder is None:
            byteorder = member
        elif len(parts) == 3 and parts[1] == "data" and parts[2] not in storages:
            storages[parts[2]] = member
        else:
            others.append(member)
    if found_pickle is None:
        raise NotPlain("no data.pkl")
    return Roles(found_pickle, byteorder, storages, others)


def layout_of(view) -> Tuple[Roles, Dict[str, Located]]:
    """The roles and places of every member of the whole archive `view`; NotPlain where
    it is not of the plain layout, or members overlap the directory."""
    view = memoryview(view)
    directory = read_directory(view, 0, len(view))
    places = {m.name: locate(m, view, 0) for m in directory.members}
    if len(places) != len(directory.members):
        raise NotPlain("two members of one name")
    for place in places.values():
        if place.start + place.size > directory.start:
            raise NotPlain(f"member '{place.name}' runs into the central directory")
    return roles(directory), places


def crc_problem(places: Sequence[Located], bytes_of, what: str,
                known: Optional[Dict[str, int]] = None) -> Optional[str]:
    """The first member whose bytes (`bytes_of(place)`, a buffer) fail their CRC-32, as
    the line check_zip_crc gives; `known`: CRC-32s already computed, by member name."""
    for place in places:
        crc = (known or {}).get(place.name)
        if crc is None:
            data = bytes_of(place)
            if len(data) != place.size:
                return f"entry '{what}': member '{place.name}' ends past the end of the entry"
            crc = zlib.crc32(data)
        if crc != place.crc:
            return f"entry '{what}': member '{place.name}' fails its CRC-32 check (the bytes changed after writing)"
    return None


def check_little_endian(byteorder_bytes: Optional[bytes]) -> None:
    """The storages are little-endian (torch.save records it; older files do not) and so
    is this host: then they are used as they are."""
    if sys.byteorder != "little" or (byteorder_bytes is not None and bytes(byteorder_bytes) != b"little"):
        raise NotPlain("not little-endian")


# ----------------------------------------------------------------------------- data.pkl

class TensorRecord(NamedTuple):
    """A tensor as data.pkl describes it: which storage (its key, its bytes), its dtype,
    and the view of it (offset, size, stride, in elements)."""
    key: str
    storage_bytes: int
    dtype: torch.dtype
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def is_dense(self) -> bool:
        """The whole storage, in row-major order: its bytes are the tensor's."""
        expected, step = [], 1
        for n in reversed(self.size):
            expected.append(step)
            step *= n
        dense_strides = all(st == e for n, st, e in zip(self.size, self.stride, reversed(expected)) if n != 1)
        return (self.offset == 0 and dense_strides
                and self.numel * self.dtype.itemsize == self.storage_bytes)

    def tensor_over(self, buffer, start: int) -> torch.Tensor:
        """The tensor, a view of `buffer` (any writable buffer) whose storage bytes begin
        at byte `start`: no copy."""
        if self.numel == 0:
            return torch.empty(self.size, dtype=self.dtype)
        base = torch.frombuffer(buffer, dtype=self.dtype, count=self.storage_bytes // self.dtype.itemsize,
                                offset=start)
        return base.as_strided(self.size, self.stride, self.offset)


class _StorageKind(NamedTuple):
    dtype: Optional[torch.dtype]  # None: an untyped storage (its length in bytes)


class _StorageRef(NamedTuple):
    key: str
    dtype: Optional[torch.dtype]
    nbytes: int


# The typed storage classes torch.save names for the dtypes that have one; other dtypes
# (fp8, unsigned 16-64 bit, ...) are saved as an untyped storage plus the dtype.
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
}


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _is_shape(value) -> bool:
    return isinstance(value, tuple) and all(_is_count(v) for v in value)


def _plain_view(storage, offset, size, stride, requires_grad, hooks, metadata, dtype) -> TensorRecord:
    if not isinstance(storage, _StorageRef):
        raise ValueError(f"the tensor's storage is a {type(storage).__name__}, not a stored one")
    if not (_is_count(offset) and _is_shape(size) and _is_shape(stride) and len(size) == len(stride)
            and isinstance(requires_grad, bool)):
        raise ValueError(f"malformed tensor view (offset {offset!r}, size {size!r}, stride {stride!r})")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"malformed tensor dtype {dtype!r}")
    if not isinstance(hooks, collections.OrderedDict) or hooks:
        raise NotPlain("backward hooks")
    if metadata:  # a conjugate or negative bit, or attributes: torch.load applies them
        raise NotPlain("tensor metadata")
    record = TensorRecord(storage.key, storage.nbytes, dtype, offset, tuple(size), tuple(stride))
    elements = storage.nbytes // dtype.itemsize
    if record.numel and offset + sum((n - 1) * st for n, st in zip(size, stride)) >= elements:
        raise ValueError(f"the tensor's view (offset {offset}, size {size}, stride {stride}) reaches past its "
                         f"storage of {elements} elements")
    return record


def _rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    if not isinstance(storage, _StorageRef) or storage.dtype is None:
        raise ValueError("_rebuild_tensor_v2 of a storage without a dtype")
    return _plain_view(storage, offset, size, stride, requires_grad, hooks, metadata, storage.dtype)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if isinstance(storage, _StorageRef) and storage.dtype is not None and storage.dtype != dtype:
        raise ValueError(f"a {storage.dtype} storage rebuilt as {dtype}")
    return _plain_view(storage, offset, size, stride, requires_grad, hooks, metadata, dtype)


def _rebuild_parameter(data, requires_grad, hooks):
    if not isinstance(data, TensorRecord) or not isinstance(requires_grad, bool):
        raise ValueError("a parameter of something other than a tensor")
    if not isinstance(hooks, collections.OrderedDict) or hooks:
        raise NotPlain("backward hooks")
    return data


# By name, as torch.<name> pickles; looked up in torch's namespace as it is (no lazy import).
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_FUNCTIONS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.storage", "UntypedStorage"): _StorageKind(None),
}
_ADMITTED = ("torch._utils._rebuild_tensor_v2/_v3/_rebuild_parameter, torch.<Type>Storage, "
             "torch.storage.UntypedStorage, torch.<dtype>, collections.OrderedDict")


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        found = _FUNCTIONS.get((module, name))
        if found is None and module == "torch":
            if name in _LEGACY_STORAGES:
                found = _StorageKind(_LEGACY_STORAGES[name])
            else:
                found = _DTYPES.get(name)
        if found is None:
            raise CheckpointError(
                f"{self.where}: its data.pkl names {module}.{name}; a tensor entry is read as what torch.save writes "
                f"for one tensor ({_ADMITTED}) and nothing else, since any other global could run code from the "
                "file: nothing was loaded")
        return found

    def persistent_load(self, pid):
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind)
                and isinstance(pid[2], str) and isinstance(pid[3], str) and _is_count(pid[4])):
            kind, numel = pid[1], pid[4]
            return _StorageRef(pid[2], kind.dtype, numel if kind.dtype is None else numel * kind.dtype.itemsize)
        raise CheckpointError(f"{self.where}: its data.pkl refers to {str(pid)[:80]}, not to a stored tensor "
                              "storage: nothing was loaded")


def check_tensor_opcodes(data: bytes, where: str) -> None:
    """Every opcode of `data` is one torch.save uses for a tensor (walked without
    building anything); CheckpointError naming `where` otherwise."""
    try:
        for opcode, _, position in pickletools.genops(data):
            if opcode.name not in _TENSOR_OPCODES:
                raise CheckpointError(f"{where}: its data.pkl uses pickle opcode {opcode.name} (byte {position}), "
                                      "which torch.save does not write for a tensor: nothing was loaded")
    except CheckpointError:
        raise
    except Exception as e:  # an unknown opcode, an argument past the end
        raise ValueError(f"unreadable data.pkl ({e})") from e


def read_tensor_pickle(data: bytes, where: str) -> TensorRecord:
    """The tensor record of data.pkl `data`: CheckpointError (naming `where`) for a global,
    opcode or persistent id that is not torch.save's for a tensor; NotPlain for a safe
    tensor not of the plain form; ValueError for anything else that is not a tensor."""
    if len(data) > _MAX_PICKLE_BYTES:
        raise NotPlain("a large data.pkl")
    check_tensor_opcodes(data, where)
    try:
        record = _TensorUnpickler(data, where).load()
    except (CheckpointError, NotPlain):
        raise
    except Exception as e:
        raise ValueError(f"unreadable data.pkl ({type(e).__name__}: {e})") from e
    if not isinstance(record, TensorRecord):
        raise ValueError(f"holds a {type(record).__name__}, not a tensor")
    return record


def read_record(roles, member_bytes, where: str) -> TensorRecord:
    """The tensor record of an entry whose members play `roles`, `member_bytes(member)`
    giving a member's bytes: data.pkl read (read_tensor_pickle), the byte order checked."""
    record = read_tensor_pickle(bytes(member_bytes(roles.pickle)), where)
    check_little_endian(None if roles.byteorder is None else member_bytes(roles.byteorder))
    return record


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the bytes of contiguous `tensor` (any dtype, any device)."""
    nbytes = tensor.numel() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (nbytes,), (1,))
