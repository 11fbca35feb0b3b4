"""Checkpoints lose nothing and are never silently wrong (Gloo, world 2):

- a save that fails on one rank (a full disk) raises on every rank and leaves the
  previous checkpoint at the path unchanged and loadable with exactly its old values;
- a corrupted byte, a missing manifest, or ranks given different paths are errors on
  every rank, before anything is loaded or written;
- load_full_state_dict refuses state dicts whose keys differ across ranks (instead of
  issuing different all-gathers on different ranks);
- an SGD checkpoint does not load into AdamW;
- each rank checks the entries it reads as it reads them (the manifest's sha256 of each
  entry's byte range, then the zip CRC-32): flipped bytes (in data or in padding no CRC
  covers), swapped or truncated files, and manifests edited so that their ranges no longer
  hash, match .metadata or tile the file are refused by name on every rank, the model
  unchanged; manifests of version 1 (one sha256 per file) still load and are verified;
  several reading threads load what one does;
- entries large enough to be read straight into each rank's pieces (no torch.load, no
  copy) load exactly, and a flipped byte in one is refused by its sha256, by its CRC-32
  where the manifest was recomputed over it, and by its CRC-32 with verify=False.

Resharding (2 -> 1, 2 -> 4) and strategy changes of verified checkpoints are covered by
test_strategies.py (checkpoint_save / checkpoint_resume) and test_torch_state_dict.py.
"""
import errno
import hashlib
import os

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.checkpoint.reader import read_metadata_file
from megatron_fsdp_ext.dcp import MANIFEST_NAME, CheckpointError, load_checkpoint, save_checkpoint
from harness import run_distributed
from harness.workers import assert_same_snapshot, build_models, checkpoint_snapshot, expect_error, shard

TINY = {"layers": 1, "d_model": 16, "ffn": 40, "vocab": 32}


def _model(seed=None):
    _, model, _ = build_models(TINY, torch.device("cpu"))
    if seed is not None:  # another initialisation: a load must overwrite all of it
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    return shard(model, {})


def _step(model, opt, seed, vocab=TINY["vocab"]):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, vocab, (2, 8), generator=g)
    model.loss(tokens, tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _files(path):
    """name -> sha256 of every file under `path`."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _siblings(path):
    head, name = os.path.split(path)
    return sorted(n for n in os.listdir(head) if n.startswith(f".{name}.mfsdp-"))


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


# ------------------------------------------------------------------------ failed save

def _failing_write(rank_to_fail):
    """Patch DCP's per-item file write so that rank `rank_to_fail` runs out of disk
    after writing a few bytes (a torn file); returns the undo."""
    import torch.distributed.checkpoint.filesystem as fs

    original = fs._write_item

    def no_space(transforms, stream, *args, **kwargs):
        stream.write(b"\0" * 7)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() == rank_to_fail:
        fs._write_item = no_space

    def undo():
        fs._write_item = original
    return undo


def failed_save_keeps_previous(rank, world, path):
    model = _model()
    opt = _adamw(model)
    _step(model, opt, 0)
    save_checkpoint(path, model, opt)
    saved = checkpoint_snapshot(model, opt)
    files = _files(path)
    _step(model, opt, 1)  # the state a failed save would have written
    changed = checkpoint_snapshot(model, opt)
    assert not torch.equal(changed[0]["norm.weight"], saved[0]["norm.weight"])

    for failing in (1, 0):  # a non-coordinator, then the rank that writes the metadata
        undo = _failing_write(failing)
        try:
            expect_error(lambda: save_checkpoint(path, model, opt), CheckpointError,
                         "writing the checkpoint failed on rank(s) [%d]" % failing, "No space left on device",
                         f"the previous checkpoint at {path} is unchanged")
        finally:
            undo()
        assert _files(path) == files, "a failed save changed the previous checkpoint's files"
        assert _siblings(path) == [], f"a failed save left {_siblings(path)}"

    fresh = _model(seed=7)
    fresh_opt = _adamw(fresh)
    _step(fresh, fresh_opt, 5)  # state of its own, to be replaced
    load_checkpoint(path, fresh, fresh_opt)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), saved, "after failed saves, the loaded checkpoint")

    # A save that succeeds replaces it, and leaves no temporary directory behind.
    save_checkpoint(path, model, opt)
    assert _siblings(path) == [] and _files(path) != files
    load_checkpoint(path, fresh, fresh_opt)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), changed, "the replaced checkpoint")
    return True


def test_failed_write_on_one_rank_keeps_previous_checkpoint(tmp_path):
    assert run_distributed(failed_save_keeps_previous, 2, str(tmp_path / "ckpt"), timeout=120) == [True, True]


# ------------------------------------------------------------------------ corruption

def corrupted_byte(rank, world, path):
    model = _model()
    opt = _adamw(model)
    _step(model, opt, 0)
    save_checkpoint(path, model, opt)
    victim = max((n for n in os.listdir(path) if n.endswith(".distcp")),
                 key=lambda n: os.path.getsize(os.path.join(path, n)))
    dist.barrier()
    if rank == 0:  # 16 payload bytes overwritten, in the middle of the largest file
        with open(os.path.join(path, victim), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(path, victim)) // 2)
            f.write(b"\xa5" * 16)
    dist.barrier()
    fresh = _model(seed=7)
    fresh_opt = _adamw(fresh)
    before = checkpoint_snapshot(fresh, fresh_opt)
    expect_error(lambda: load_checkpoint(path, fresh, fresh_opt), CheckpointError,
                 "the checkpoint is corrupted", f"'{victim}' has sha256", "the manifest expects")
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), before, "a refused load changed the model")
    return True


def test_corrupted_byte_is_an_error_on_load(tmp_path):
    assert run_distributed(corrupted_byte, 2, str(tmp_path / "ckpt"), timeout=120) == [True, True]


# ------------------------------------------------------------------------ paths

def different_paths(rank, world, root):
    model = _model()
    opt = _adamw(model)
    mine = os.path.join(root, f"rank{rank}")
    expect_error(lambda: save_checkpoint(mine, model, opt), ValueError, "different checkpoint paths",
                 f"rank 0: {root}/rank0", f"rank 1: {root}/rank1")
    dist.barrier()
    assert not os.path.exists(mine) and os.listdir(root) == [], "a refused save wrote something"
    for name in ("rank0", "rank1"):  # two good checkpoints, of different states
        save_checkpoint(os.path.join(root, name), model, opt)
        _step(model, opt, 0)
    fresh = _model(seed=7)
    before = checkpoint_snapshot(fresh)
    expect_error(lambda: load_checkpoint(mine, fresh), ValueError, "different checkpoint paths",
                 f"rank 0: {root}/rank0", f"rank 1: {root}/rank1")
    assert_same_snapshot(checkpoint_snapshot(fresh), before, "a refused load changed the model")
    return True


def test_different_paths_per_rank_fail_on_save_and_load(tmp_path):
    assert run_distributed(different_paths, 2, str(tmp_path), timeout=120) == [True, True]


# ------------------------------------------------------------------------ manifest

def no_manifest(rank, world, root):
    import torch.distributed.checkpoint as dcp

    model = _model()
    path = os.path.join(root, "ckpt")
    save_checkpoint(path, model)
    expected = checkpoint_snapshot(model)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(path, MANIFEST_NAME))  # as if the save stopped before its last step
    dist.barrier()
    fresh = _model(seed=7)
    before = checkpoint_snapshot(fresh)
    expect_error(lambda: load_checkpoint(path, fresh), CheckpointError, f"has no {MANIFEST_NAME}",
                 "incomplete or interrupted save", "not written by save_checkpoint", "verify=False")
    assert_same_snapshot(checkpoint_snapshot(fresh), before, "a refused load changed the model")
    load_checkpoint(path, fresh, verify=False)  # the explicit way to read an unverified one
    assert_same_snapshot(checkpoint_snapshot(fresh), expected, "an unverified load")

    empty = os.path.join(root, "empty")
    if rank == 0:
        os.makedirs(empty)
    dist.barrier()
    expect_error(lambda: load_checkpoint(empty, fresh), CheckpointError, f"has no {MANIFEST_NAME}",
                 "incomplete or interrupted save", "no torch.distributed.checkpoint .metadata")

    # A DCP checkpoint of torch's own state dict (another tool's layout): how to load it.
    foreign = os.path.join(root, "foreign")
    dcp.save(model.state_dict(), checkpoint_id=foreign)
    expect_error(lambda: load_checkpoint(foreign, fresh), CheckpointError, f"has no {MANIFEST_NAME}",
                 "dcp.load", "get_model_state_dict", "set_model_state_dict")
    assert_same_snapshot(checkpoint_snapshot(fresh), expected, "a refused load changed the model")
    return True


def test_directory_without_manifest_is_refused(tmp_path):
    assert run_distributed(no_manifest, 2, str(tmp_path), timeout=120) == [True, True]


# ------------------------------------------------------------------------ round trip

def round_trip(rank, world, path):
    import json

    model = _model()
    opt = _adamw(model)
    for s in range(2):
        _step(model, opt, s)
    save_checkpoint(path, model, opt)
    saved = checkpoint_snapshot(model, opt)
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    on_disk = _files(path)
    assert set(manifest["files"]) == set(on_disk) - {MANIFEST_NAME}, (manifest["files"], on_disk)
    assert manifest["version"] == 2 and manifest["world_size"] == world
    # .metadata hashed whole; each data file by ranges that tile it, one per entry.
    assert manifest["files"][".metadata"] == {"sha256": on_disk[".metadata"],
                                              "size": os.path.getsize(os.path.join(path, ".metadata"))}
    stored = {(info.relative_path, info.offset, info.length)
              for info in read_metadata_file(os.path.join(path, ".metadata")).storage_data.values()}
    for name, record in manifest["files"].items():
        if name == ".metadata":
            continue
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert record["size"] == len(data) and "sha256" not in record, (name, record)
        cursor = 0
        for offset, length, digest in record["entries"]:
            assert offset == cursor and hashlib.sha256(data[offset:offset + length]).hexdigest() == digest
            assert (name, offset, length) in stored, f"'{name}': range {offset}+{length} is no entry (DCP's tile)"
            cursor += length
        assert cursor == len(data), f"'{name}': the ranges end at {cursor} of {len(data)} bytes"
    assert {n for n, _, _ in stored} == set(manifest["files"]) - {".metadata"}

    fresh = _model(seed=7)
    fresh_opt = _adamw(fresh)
    load_checkpoint(path, fresh, fresh_opt)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), saved, "the round trip")
    _step(model, opt, 9)
    _step(fresh, fresh_opt, 9)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), checkpoint_snapshot(model, opt), "a step after the round trip")
    return True


def test_round_trip_is_exact_and_manifest_lists_every_file(tmp_path):
    assert run_distributed(round_trip, 2, str(tmp_path / "ckpt"), timeout=120) == [True, True]


# ------------------------------------------------------------------------ load_full_state_dict

def full_state_dict_keys_differ(rank, world):
    model = _model()
    good = mfsdp.full_state_dict(model, rank0_only=False)
    before = checkpoint_snapshot(model)
    other = _model(seed=7)
    everything = mfsdp.full_state_dict(other, rank0_only=False)
    partial = dict(everything)
    key = "blocks.0.attn.wqkv.weight"
    if rank == 1:
        del partial[key]  # only rank 1 would gather block 0's parameters
    expect_error(lambda: mfsdp.load_full_state_dict(model, partial, strict=False), ValueError,
                 "the ranks passed different keys", f"'{key}' is in the state dict of rank(s) [0]",
                 "not of rank(s) [1]")
    # Same keys, but rank 1's value has another shape: an error on every rank too.
    bad = dict(good)
    if rank == 1:
        bad[key] = torch.zeros(3, 3)
    if rank == 1:
        expect_error(lambda: mfsdp.load_full_state_dict(model, bad, strict=False), ValueError,
                     f"'{key}' has shape (3, 3)")
    else:
        expect_error(lambda: mfsdp.load_full_state_dict(model, bad, strict=False), RuntimeError,
                     "failed on rank(s) [1]", f"'{key}' has shape (3, 3)")
    # Nothing was loaded, and the ranks are still in step.
    assert_same_snapshot(checkpoint_snapshot(model), before, "a refused load_full_state_dict changed the model")
    mfsdp.load_full_state_dict(model, everything, strict=False)
    assert_same_snapshot(checkpoint_snapshot(model), checkpoint_snapshot(other), "load_full_state_dict after the refusals")
    return True


def test_load_full_state_dict_keys_differing_across_ranks_raise_everywhere():
    assert run_distributed(full_state_dict_keys_differ, 2, timeout=60) == [True, True]


# ------------------------------------------------------------------------ optimizer class

def sgd_into_adamw(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from harness.flat_format import flat_state_dict
    from megatron_fsdp_ext.checkpoint.dcp_flat import quiet

    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, sgd, 0)
    path = os.path.join(root, "sgd")
    save_checkpoint(path, model, sgd)
    fresh = _model(seed=7)
    adamw = _adamw(fresh)
    before = checkpoint_snapshot(fresh, adamw)
    expect_error(lambda: load_checkpoint(path, fresh, adamw), ValueError,
                 "the checkpoint was saved from SGD", "this optimizer is AdamW", "nothing was loaded")
    assert_same_snapshot(checkpoint_snapshot(fresh, adamw), before, "a refused load changed the model or optimizer")
    # A checkpoint of the flat format that does not name its optimizer (older ones): told
    # by the hyper-parameters.
    unnamed = flat_state_dict(model, sgd)
    del unnamed["optim.class"]
    with quiet():
        dcp.save(unnamed, checkpoint_id=os.path.join(root, "unnamed"))
    expect_error(lambda: load_checkpoint(os.path.join(root, "unnamed"), fresh, adamw, verify=False), ValueError,
                 "hyper-parameters ['dampening', 'momentum', 'nesterov']", "this AdamW does not have")
    assert_same_snapshot(checkpoint_snapshot(fresh, adamw), before, "a refused load changed the model or optimizer")
    # The same class loads.
    load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    return True


def test_sgd_checkpoint_into_adamw_is_a_clear_error(tmp_path):
    assert run_distributed(sgd_into_adamw, 2, str(tmp_path), timeout=120) == [True, True]


# ------------------------------------------------------------------------ verified as read

def _manifest(path):
    import json
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return json.load(f)


def _write_manifest(path, manifest):
    import json
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def _largest_entry(path):
    """(file, offset, length, key) of the largest entry .metadata places in a data file."""
    storage = read_metadata_file(os.path.join(path, ".metadata")).storage_data
    index, info = max(storage.items(), key=lambda kv: kv[1].length)
    return info.relative_path, info.offset, info.length, index.fqn


def _on_rank0(fn):
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _case(good, root, name, change):
    """A copy of checkpoint `good` at root/name, changed by change(path) on rank 0."""
    import shutil

    path = os.path.join(root, name)

    def make():
        shutil.copytree(good, path)
        change(path)

    _on_rank0(make)
    return path


def _message_of(fn):
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    raise AssertionError("no CheckpointError raised")


def _flip(path, name, at):
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def verified_as_read(rank, world, root):
    """Version-2 manifests: every data file by byte ranges, one per entry. Each rank checks
    the entries it reads right after reading them (sha256 against the manifest's range, then
    the zip CRC-32), the file sizes, that .metadata's entries are the manifest's ranges and
    that the ranges tile each file; whatever differs is refused on every rank, naming the
    file (and the entry), and the model is left as it was."""
    model = _model()
    opt = _adamw(model)
    _step(model, opt, 0)
    good = os.path.join(root, "good")
    save_checkpoint(good, model, opt)
    saved = checkpoint_snapshot(model, opt)
    name, offset, length, key = _largest_entry(good)
    fresh = _model(seed=7)
    fresh_opt = _adamw(fresh)
    _step(fresh, fresh_opt, 3)
    before = checkpoint_snapshot(fresh, fresh_opt)

    def refused(path, *fragments):
        expect_error(lambda: load_checkpoint(path, fresh, fresh_opt), CheckpointError, *fragments)
        assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), before, f"a refused load ({path}) changed it")

    # A flipped byte in the middle of an entry that a rank loads: its sha256 differs.
    flipped = _case(good, root, "flipped", lambda p: _flip(p, name, offset + length // 2))
    refused(flipped, "the checkpoint is corrupted", f"'{name}' has sha256", f"at bytes {offset}-{offset + length}",
            f"(entry '{key}')", "the manifest expects")

    # A flipped byte that no CRC-32 covers (the alignment padding torch.save puts in a zip
    # header): torch.load would read the same values, but the bytes are not the saved ones.
    def flip_padding(p):
        with open(os.path.join(p, name), "rb") as f:
            f.seek(offset)
            entry = f.read(length)
        _flip(p, name, offset + entry.index(b"ZZZZ"))

    padding = _case(good, root, "padding", flip_padding)
    refused(padding, f"'{name}' has sha256", f"(entry '{key}')")

    # Two data files swapped.
    data = sorted(n for n in _manifest(good)["files"] if n != ".metadata")

    def swap(p):
        a, b = (os.path.join(p, n) for n in data[:2])
        os.rename(a, a + ".x")
        os.rename(b, a)
        os.rename(a + ".x", b)

    swapped = _case(good, root, "swapped", swap)
    message = _message_of(lambda: load_checkpoint(swapped, fresh, fresh_opt))
    assert "the checkpoint is corrupted" in message and any(f"'{n}' has" in message for n in data[:2]), message
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), before, "a refused load (swapped) changed the model")

    # A truncated file: its size differs (and the entry past the end cannot be read).
    def truncate(p):
        with open(os.path.join(p, name), "r+b") as f:
            f.truncate(offset + length // 2)

    truncated = _case(good, root, "truncated", truncate)
    size = os.path.getsize(os.path.join(good, name))
    refused(truncated, "the checkpoint is corrupted",
            f"'{name}' has {offset + length // 2} bytes, the manifest expects {size}")

    # The manifest edited: a range's hash, two ranges merged into one (tiling kept, but
    # .metadata's entries are no longer its ranges), a range dropped (no longer tiling).
    def edit(change):
        def apply(p):
            manifest = _manifest(p)
            change(manifest["files"][name]["entries"])
            _write_manifest(p, manifest)
        return apply

    def other_hash(ranges):
        entry = next(r for r in ranges if r[0] == offset)
        entry[2] = hashlib.sha256(b"other").hexdigest()

    def merged(ranges):
        first, second = ranges[0], ranges[1]
        ranges[:2] = [[first[0], first[1] + second[1], first[2]]]

    refused(_case(good, root, "rehashed", edit(other_hash)), f"'{name}' has sha256", f"(entry '{key}')")
    refused(_case(good, root, "merged", edit(merged)), "its .metadata places", f"of '{name}'",
            "which its manifest does not list")
    refused(_case(good, root, "dropped", edit(lambda ranges: ranges.pop(0))), f"the record of '{name}'",
            "do not tile the file")

    # The untouched checkpoint still loads, exactly.
    load_checkpoint(good, fresh, fresh_opt)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), saved, "the verified load")
    return True


def test_entries_are_verified_as_they_are_read(tmp_path):
    assert run_distributed(verified_as_read, 2, str(tmp_path), timeout=240) == [True, True]


def manifest_v1(rank, world, root):
    """A checkpoint whose manifest is of version 1 (one sha256 per file, as save_checkpoint
    wrote before) loads exactly, and is still verified: a flipped byte is refused, naming the
    file's sha256 (each file hashed whole, by one rank)."""
    from megatron_fsdp_ext.checkpoint.files import file_digest

    model = _model()
    opt = _adamw(model)
    _step(model, opt, 0)
    good = os.path.join(root, "good")
    save_checkpoint(good, model, opt)
    saved = checkpoint_snapshot(model, opt)

    def as_v1(p):
        manifest = _manifest(p)
        manifest["version"] = 1
        for name in manifest["files"]:
            digest, size = file_digest(os.path.join(p, name))
            manifest["files"][name] = {"sha256": digest, "size": size}
        _write_manifest(p, manifest)

    v1 = _case(good, root, "v1", as_v1)
    fresh = _model(seed=7)
    fresh_opt = _adamw(fresh)
    load_checkpoint(v1, fresh, fresh_opt)
    assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), saved, "the load of a version-1 manifest")

    name, offset, length, key = _largest_entry(good)
    flipped = _case(v1, root, "v1_flipped", lambda p: _flip(p, name, offset + length // 2))
    other = _model(seed=9)
    other_opt = _adamw(other)
    before = checkpoint_snapshot(other, other_opt)
    size = os.path.getsize(os.path.join(good, name))
    expect_error(lambda: load_checkpoint(flipped, other, other_opt), CheckpointError, "the checkpoint is corrupted",
                 f"'{name}' has sha256", f"({size} bytes), the manifest expects")
    assert_same_snapshot(checkpoint_snapshot(other, other_opt), before, "a refused load changed the model")
    return True


def test_version_1_manifest_still_loads_and_is_verified(tmp_path):
    assert run_distributed(manifest_v1, 2, str(tmp_path), timeout=240) == [True, True]


def threads_read_alike(rank, world, root):
    """Reading with several threads gives the values one thread gives (and the saved ones),
    and several threads do read: where each rank reads its pieces of the shards
    (read_locally) and where dcp.load reads the DTensors (read_into, DCP's planner)."""
    import threading

    import megatron_fsdp_ext.dcp as dcp_module
    from megatron_fsdp_ext.checkpoint.reader import SafeFileSystemReader

    model = _model()
    opt = _adamw(model)
    for s in range(2):
        _step(model, opt, s)
    path = os.path.join(root, "ckpt")
    save_checkpoint(path, model, opt)
    saved = checkpoint_snapshot(model, opt)
    originals = dcp_module._READ_THREADS, SafeFileSystemReader._read_entry, dcp_module.piece_targets
    readers = set()

    def counting(self, *args, **kwargs):
        readers.add(threading.get_ident())
        return originals[1](self, *args, **kwargs)

    got = {}
    SafeFileSystemReader._read_entry = counting
    try:
        for way in ("pieces", "dcp.load"):
            # No pieces: the load reads the DTensors through dcp.load.
            dcp_module.piece_targets = originals[2] if way == "pieces" else (lambda flat, made: None)
            for threads in (1, 4):
                dcp_module._READ_THREADS = threads
                readers.clear()
                fresh = _model(seed=7)
                fresh_opt = _adamw(fresh)
                load_checkpoint(path, fresh, fresh_opt)
                got[way, threads] = (checkpoint_snapshot(fresh, fresh_opt), len(readers))
    finally:
        dcp_module._READ_THREADS, SafeFileSystemReader._read_entry, dcp_module.piece_targets = originals
    for way in ("pieces", "dcp.load"):
        one, four = got[way, 1], got[way, 4]
        assert one[1] == 1 and four[1] > 1, f"{way}: threads that read entries: {one[1]} and {four[1]}"
        assert_same_snapshot(four[0], one[0], f"{way}: four reading threads against one")
        assert_same_snapshot(one[0], saved, f"{way}: the load")
    return True


def test_several_reading_threads_load_what_one_does(tmp_path):
    assert run_distributed(threads_read_alike, 2, str(tmp_path), timeout=240) == [True, True]


# Entries of a few MiB: read straight into the ranks' pieces (checkpoint_reader._stream_entry).
LARGE = {"layers": 1, "d_model": 768, "ffn": 2048, "vocab": 2048}


def _large_model(seed=None):
    _, model, _ = build_models(LARGE, torch.device("cpu"))
    if seed is not None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    return shard(model, {})


def large_entries(rank, world, root):
    """Entries of 1 MiB and more are read straight into each rank's pieces of the shards
    (their bytes hashed and CRC-checked as they arrive): they load exactly, on one reading
    thread or several, and also through dcp.load's planner (read whole, then copied); a
    flipped byte in the storage of one is refused naming the file and the entry (sha256),
    the model unchanged; with the manifest recomputed over the flipped byte, its CRC-32
    refuses it, and with verify=False too."""
    import megatron_fsdp_ext.checkpoint.reader as reader
    import megatron_fsdp_ext.dcp as dcp_module
    from megatron_fsdp_ext.checkpoint import tensor_entry
    from harness.trust_workers import reseal

    model = _large_model()
    opt = _adamw(model)
    _step(model, opt, 0, vocab=LARGE["vocab"])
    good = os.path.join(root, "good")
    save_checkpoint(good, model, opt)
    saved = checkpoint_snapshot(model, opt)
    name, offset, length, key = _largest_entry(good)
    assert length >= reader._STREAM_MIN_BYTES, length

    streamed = []
    original = reader._Scratch.stream

    def counting(self, *args, **kwargs):
        streamed.append(args[2])
        return original(self, *args, **kwargs)

    originals = dcp_module._READ_THREADS, dcp_module.piece_targets
    reader._Scratch.stream = counting
    try:
        for way, threads in (("pieces", 1), ("pieces", 4), ("dcp.load", 2)):
            dcp_module._READ_THREADS = threads
            dcp_module.piece_targets = originals[1] if way == "pieces" else (lambda flat, made: None)
            streamed.clear()
            fresh = _large_model(seed=7)
            fresh_opt = _adamw(fresh)
            load_checkpoint(good, fresh, fresh_opt)
            assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), saved, f"{way}, {threads} threads")
            assert (len(streamed) > 0) == (way == "pieces"), f"{way}: {len(streamed)} entries read straight in"
    finally:
        reader._Scratch.stream = original
        dcp_module._READ_THREADS, dcp_module.piece_targets = originals

    def flip_storage(p):
        with open(os.path.join(p, name), "rb") as f:
            f.seek(offset)
            entry = f.read(length)
        roles, places = tensor_entry.layout_of(entry)
        storage = places[next(iter(roles.storages.values())).name]
        _flip(p, name, offset + storage.start + storage.size // 3)

    fresh = _large_model(seed=7)
    fresh_opt = _adamw(fresh)
    _step(fresh, fresh_opt, 3, vocab=LARGE["vocab"])
    before = checkpoint_snapshot(fresh, fresh_opt)

    def refused(path, *fragments, **kwargs):
        expect_error(lambda: load_checkpoint(path, fresh, fresh_opt, **kwargs), CheckpointError, *fragments)
        assert_same_snapshot(checkpoint_snapshot(fresh, fresh_opt), before, f"a refused load ({path}) changed it")

    flipped = _case(good, root, "flipped", flip_storage)
    refused(flipped, "the checkpoint is corrupted", f"'{name}' has sha256", f"(entry '{key}')")
    refused(flipped, name, f"entry '{key}'", "fails its CRC-32 check", verify=False)
    resealed = _case(good, root, "resealed", lambda p: (flip_storage(p), reseal(p)))
    refused(resealed, "the checkpoint is corrupted", f"'{name}': entry '{key}'", "fails its CRC-32 check")
    return True


def test_large_entries_load_straight_into_pieces_and_are_verified(tmp_path):
    assert run_distributed(large_entries, 2, str(tmp_path), timeout=300) == [True, True]
