"""tensor_entry and the reader built on it: a DCP tensor entry (a torch.save archive of
one tensor) read without torch.load.

- what torch.save writes for one tensor reads back bit for bit: every dtype (bf16, fp8,
  bool, complex included), views with an offset or other strides, 0-d and empty tensors,
  parameters, archives in zip64 form;
- a data.pkl that names any other global, a persistent id that is not a storage, or an
  opcode torch.save does not write for a tensor is refused, naming the entry, and runs
  nothing;
- through SafeFileSystemReader (checkpoints written by hand, no process group): large
  entries are read straight into their destinations (whole or in ranges), small ones
  through a buffer, neither through torch.load; a flipped byte is refused by its CRC-32
  or the manifest's sha256 on either path; safe entries of another form (a conjugate
  bit) still load, through torch.load.
"""
import io
import os
import pickle
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

import megatron_fsdp_ext.checkpoint.reader as reader
from megatron_fsdp_ext.checkpoint import tensor_entry
from megatron_fsdp_ext.checkpoint.files import MANIFEST_FORMAT, CheckpointError, Verification, data_file_records
from megatron_fsdp_ext.checkpoint.pieces import PieceTarget, read_locally

DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex32", "complex64", "complex128") if hasattr(torch, name)]


def _random(shape, dtype, seed=0):
    """Any bit patterns of `dtype` (NaNs included), as saved bytes would hold."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _read(data: bytes, where="file.distcp (entry 'w')"):
    """The tensor of archive `data`, as the reader builds it: a view of the bytes."""
    roles, places = tensor_entry.layout_of(data)
    pkl = places[roles.pickle.name]
    record = tensor_entry.read_tensor_pickle(data[pkl.start:pkl.start + pkl.size], where)
    buffer = bytearray(data)
    return record, record.tensor_over(buffer, places[roles.storages[record.key].name].start)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_reads_as_saved(dtype):
    t = _random((3, 5), dtype)
    record, got = _read(_saved(t))
    assert record.is_dense() and _same(got, t)
    assert _same(got, torch.load(io.BytesIO(_saved(t)), weights_only=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64] +
                         [getattr(torch, "float8_e4m3fn")] * hasattr(torch, "float8_e4m3fn"), ids=str)
def test_views_with_offsets_and_strides_read_as_saved(dtype):
    base = _random((6, 4), dtype, seed=1)
    for view in (base.t(), base[2:5], base[:, 1], base[::2, 1:3], base.reshape(-1)[3:7], base[4]):
        record, got = _read(_saved(view))
        assert not record.is_dense()  # torch.save keeps the whole storage and the view on it
        assert _same(got, view), (view.shape, view.stride(), view.storage_offset())


def test_zero_dim_empty_and_parameter_tensors_read_as_saved():
    cases = [torch.tensor(3.5), torch.tensor(True), torch.zeros(0, 4), torch.zeros(4, 0, dtype=torch.bfloat16),
             torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4), requires_grad=False)]
    for t in cases:
        _, got = _read(_saved(t))
        assert _same(got, t.detach()) and type(got) is torch.Tensor


def test_a_zip64_archive_reads_as_saved(monkeypatch):
    """The same members written in zip64 form (as torch.save writes entries of 4 GiB or
    more): sizes and offsets in zip64 extra fields, a zip64 end record."""
    t = _random((5, 7), torch.float32, seed=2)
    plain = zipfile.ZipFile(io.BytesIO(_saved(t)))
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 0)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 0)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        for info in plain.infolist():
            z.writestr(info.filename, plain.read(info))
    data = out.getvalue()
    assert b"PK\x06\x06" in data[-200:]  # the zip64 end record: the form is the one meant
    directory = tensor_entry.read_directory(data, 0, len(data))
    assert len(directory.members) == len(plain.infolist())
    _, got = _read(data)
    assert _same(got, t)


def test_compressed_or_garbled_archives_are_not_plain():
    t = torch.randn(4)
    plain = zipfile.ZipFile(io.BytesIO(_saved(t)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in plain.infolist():
            z.writestr(info.filename, plain.read(info))
    for data in (out.getvalue(), _saved(t)[:-5], b"", b"PK\x05\x06" + bytes(18)):
        with pytest.raises(tensor_entry.NotPlain):
            tensor_entry.layout_of(data)


# ----------------------------------------------------------------------------- refusals

class _Calls:
    """Pickles as a call of `fn(*args)`: what a forged data.pkl would hold."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _forged_pickles(marker):
    import builtins
    import posixpath
    yield "os.system", pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=2)
    yield "builtins.eval", pickle.dumps(_Calls(builtins.eval, f"open({marker!r}, 'w')"), protocol=2)
    yield "builtins.open", pickle.dumps(_Calls(builtins.open, marker, "w"), protocol=4)
    yield "posixpath.join", pickle.dumps(_Calls(posixpath.join, "a", "b"), protocol=2)
    yield "torch.serialization.load", pickle.dumps(_Calls(torch.load, marker), protocol=2)
    yield "torch._utils._rebuild_qtensor", b"\x80\x02ctorch._utils\n_rebuild_qtensor\n)R."
    yield "torch.nn.modules.linear.Linear", pickle.dumps(_Calls(torch.nn.Linear, 2, 2), protocol=2)
    # A tensor rebuild whose argument calls something else.
    yield "posix.getcwd", (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(cposix\ngetcwd\n)R"
                           b"K\x00)K\x01)\x89ccollections\nOrderedDict\n)RtR.")


def test_a_data_pkl_naming_any_other_global_is_refused_naming_the_entry(tmp_path):
    marker = str(tmp_path / "ran")
    where = "/ckpt/__0_0.distcp (entry 'layers.0.weight')"
    for name, data in _forged_pickles(marker):
        with pytest.raises(CheckpointError) as e:
            tensor_entry.read_tensor_pickle(data, where)
        assert where in str(e.value) and name.rsplit(".", 1)[-1] in str(e.value), (name, str(e.value))
        assert not os.path.exists(marker), f"reading the forged data.pkl ({name}) ran its code"


def test_other_persistent_ids_and_opcodes_are_refused():
    where = "f.distcp (entry 'w')"
    good = _saved(torch.randn(3))
    pkl = zipfile.ZipFile(io.BytesIO(good)).read("archive/data.pkl")
    # The persistent id's tag changed from 'storage': refused.
    forged = pkl.replace(b"storage", b"storbge", 1)
    with pytest.raises(CheckpointError, match=r"f\.distcp \(entry 'w'\): its data.pkl refers to"):
        tensor_entry.read_tensor_pickle(forged, where)
    # A BUILD after the tensor (setting attributes): torch.save writes none for a tensor.
    forged = pkl[:-1] + b"}b."
    with pytest.raises(CheckpointError, match=r"f\.distcp \(entry 'w'\): its data.pkl uses pickle opcode BUILD"):
        tensor_entry.read_tensor_pickle(forged, where)
    # Not a tensor at all: a clear error, not a refusal of a global.
    with pytest.raises(ValueError, match="holds a int, not a tensor"):
        tensor_entry.read_tensor_pickle(pickle.dumps(7, protocol=2), where)
    # A view reaching past its storage.
    forged = pkl.replace(b"K\x00K\x03\x85", b"K\x05K\x03\x85", 1)
    assert forged != pkl
    with pytest.raises(ValueError, match="reaches past its storage"):
        tensor_entry.read_tensor_pickle(forged, where)


def test_safe_tensors_of_another_form_are_not_plain():
    conj = torch.randn(3, dtype=torch.complex64).conj()
    data = _saved(conj)
    roles, places = tensor_entry.layout_of(data)
    pkl = places[roles.pickle.name]
    with pytest.raises(tensor_entry.NotPlain):
        tensor_entry.read_tensor_pickle(data[pkl.start:pkl.start + pkl.size], "w")
    with pytest.raises(tensor_entry.NotPlain):
        tensor_entry.check_little_endian(b"big")
    tensor_entry.check_little_endian(b"little")
    tensor_entry.check_little_endian(None)


def test_contiguous_ranges_of_a_chunk():
    rng = reader._contiguous_range
    assert rng((4, 6), (1, 0), (2, 6)) == 6  # whole rows
    assert rng((4, 6), (1, 2), (1, 3)) == 8  # part of one row
    assert rng((4, 6), (1, 2), (2, 3)) is None  # parts of two rows
    assert rng((3, 4, 5), (1, 2, 0), (1, 2, 5)) == 30
    assert rng((3, 4, 5), (1, 2, 0), (2, 2, 5)) is None
    assert rng((), (), ()) == 0


# ----------------------------------------------------------------------------- through the reader

def _write_checkpoint(directory, entries, name="__0_0.distcp"):
    """A DCP checkpoint of one data file, written by hand: `entries` maps a key to its
    tensor (stored as one chunk) or to (archive bytes, dtype, shape) for a forged one."""
    os.makedirs(directory, exist_ok=True)
    state, storage, offset = {}, {}, 0
    with open(os.path.join(directory, name), "wb") as f:
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                data, dtype, shape = _saved(value), value.dtype, tuple(value.shape)
            else:
                data, dtype, shape = value
            f.write(data)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
            state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                                               chunks=[chunk])
            storage[MetadataIndex(key, torch.Size([0] * len(shape)))] = _StorageInfo(name, offset, len(data))
            offset += len(data)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def _load(directory, metadata, targets, verification=None, threads=1):
    read_locally(str(directory), metadata, targets, verification, threads)
    return targets


def _entries():
    """Large entries (read straight into their destinations) and small ones, of several
    dtypes and shapes."""
    return {"big_f32": _random((512, 1024), torch.float32, 3), "big_bf16": _random((1024, 768), torch.bfloat16, 4),
            "big_bool": _random((3, 512, 1024), torch.bool, 5), "big_c64": _random((300, 512), torch.complex64, 6),
            "small": _random((3, 7), torch.float64, 7), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}


def test_entries_load_exactly_without_torch_load(tmp_path, monkeypatch):
    entries = _entries()
    metadata = _write_checkpoint(tmp_path, entries)
    streamed = []
    original_stream = reader._Scratch.stream

    def counting(self, *args, **kwargs):
        streamed.append(args)
        return original_stream(self, *args, **kwargs)

    monkeypatch.setattr(reader._Scratch, "stream", counting)
    monkeypatch.setattr(reader.torch, "load", lambda *a, **k: pytest.fail("torch.load read a plain entry"))
    for threads in (1, 3):
        streamed.clear()
        targets = _load(tmp_path, metadata, {k: torch.full_like(v, 0) for k, v in entries.items()}, threads=threads)
        for key, value in entries.items():
            assert _same(targets[key], value), key
        assert len(streamed) == 4  # the four large entries, straight into their targets


def test_ranges_of_entries_load_straight_into_pieces(tmp_path):
    """Targets that take part of an entry (a rank's piece of a parameter: a partial first
    row, whole rows, a partial last row) are filled from the ranges of the bytes."""
    entries = _entries()
    metadata = _write_checkpoint(tmp_path, entries)
    for key in ("big_f32", "big_bool", "big_c64"):
        full = entries[key]
        for start, count in ((0, full.numel()), (1000, 70000), (full.numel() - 5, 5), (333, 1)):
            piece = torch.zeros(count, dtype=full.dtype)
            _load(tmp_path, metadata, {key: PieceTarget(full.shape, piece, start)})
            assert _same(piece, full.reshape(-1)[start:start + count]), (key, start, count)


def test_a_forged_entry_is_refused_naming_the_file_and_entry(tmp_path):
    marker = str(tmp_path / "ran")
    for size in ((4,), (512, 1024)):  # read whole, and (would be) read straight into its target
        t = torch.randn(size)
        archive = zipfile.ZipFile(io.BytesIO(_saved(t)))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:  # valid CRCs: only the reader's refusal stops it
            for info in archive.infolist():
                data = archive.read(info)
                if info.filename.endswith("data.pkl"):
                    data = pickle.dumps(_Calls(os.system, f"touch {marker}"), protocol=2)
                z.writestr(info.filename, data)
        directory = tmp_path / f"forged_{len(size)}"
        metadata = _write_checkpoint(directory, {"w": (out.getvalue(), torch.float32, size)})
        with pytest.raises(CheckpointError) as e:
            _load(directory, metadata, {"w": torch.zeros(size)})
        text = str(e.value)
        assert os.path.join(str(directory), "__0_0.distcp") in text and "entry 'w'" in text and "system" in text, text
        assert not os.path.exists(marker)


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def test_flipped_bytes_are_refused_on_either_path(tmp_path):
    """Without a manifest the CRC-32 refuses a flipped byte (raised, naming the file);
    with one, the entry's sha256 (recorded, naming the file and entry); with the manifest
    recomputed over the flipped byte, the CRC-32 (recorded)."""
    entries = {"big": _random((512, 1024), torch.float32, 8), "small": _random((5, 5), torch.float32, 9)}
    for key in entries:
        directory = tmp_path / key
        metadata = _write_checkpoint(directory, entries)
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
        data_file = os.path.join(str(directory), "__0_0.distcp")
        manifest = _manifest(directory, metadata)
        roles, places = tensor_entry.layout_of(_saved(entries[key]))
        storage = places[roles.storages["0"].name]
        _flip(data_file, info.offset + storage.start + storage.size // 2)  # inside the storage's bytes
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*fails its CRC-32 check"):
            _load(directory, metadata, {k: torch.zeros_like(v) for k, v in entries.items()})
        verification = Verification("load", str(directory), manifest, 0, 1, 1)
        _load(directory, metadata, {k: torch.zeros_like(v) for k, v in entries.items()}, verification)
        found = verification.corrupted()
        assert len(found) == 1 and "'__0_0.distcp' has sha256" in found[0] and f"(entry '{key}')" in found[0], found
        resealed = Verification("load", str(directory), _manifest(directory, metadata), 0, 1, 1)
        _load(directory, metadata, {k: torch.zeros_like(v) for k, v in entries.items()}, resealed)
        found = resealed.corrupted()
        assert len(found) == 1 and "'__0_0.distcp': entry" in found[0] and "fails its CRC-32 check" in found[0], found


def _manifest(directory, metadata):
    ranges = {}
    for info in metadata.storage_data.values():
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    files = data_file_records(str(directory), ranges, threads=1)
    return {"format": MANIFEST_FORMAT, "version": 2, "world_size": 1, "files": files}


def test_an_intact_checkpoint_verifies_and_loads(tmp_path):
    entries = _entries()
    metadata = _write_checkpoint(tmp_path, entries)
    verification = Verification("load", str(tmp_path), _manifest(tmp_path, metadata), 0, 1, 1)
    targets = _load(tmp_path, metadata, {k: torch.zeros_like(v) for k, v in entries.items()}, verification)
    assert verification.corrupted() == []
    assert all(_same(targets[k], v) for k, v in entries.items())


def test_safe_entries_of_another_form_load_through_torch_load(tmp_path):
    conj = torch.randn(300, 512, dtype=torch.complex64).conj()  # saved with its conjugate bit
    metadata = _write_checkpoint(tmp_path, {"c": conj})
    targets = _load(tmp_path, metadata, {"c": torch.zeros(300, 512, dtype=torch.complex64)})
    assert torch.equal(targets["c"], conj.resolve_conj())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_targets_load_through_page_locked_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_BLOCK_BYTES", 1 << 20)  # several blocks per entry, the ring reused
    entries = _entries()
    metadata = _write_checkpoint(tmp_path, entries)
    for threads in (1, 3):
        targets = _load(tmp_path, metadata, {k: torch.zeros_like(v, device="cuda") for k, v in entries.items()},
                        threads=threads)
        torch.cuda.synchronize()
        for key, value in entries.items():
            assert _same(targets[key].cpu(), value), key
    full = entries["big_f32"]
    piece = torch.zeros(70000, device="cuda")
    _load(tmp_path, metadata, {"big_f32": PieceTarget(full.shape, piece, 1000)})
    assert _same(piece.cpu(), full.reshape(-1)[1000:71000])
