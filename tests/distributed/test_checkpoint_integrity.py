"""Checkpoints lose nothing and are never silently wrong (Gloo, world 2):

- a save that fails on one rank (a full disk) raises on every rank and leaves the
  previous checkpoint at the path unchanged and loadable with exactly its old values;
- a corrupted byte, a missing manifest, or ranks given different paths are errors on
  every rank, before anything is loaded or written;
- load_full_state_dict refuses state dicts whose keys differ across ranks (instead of
  issuing different all-gathers on different ranks);
- an SGD checkpoint does not load into AdamW.

Resharding (2 -> 1, 2 -> 4) and strategy changes of verified checkpoints are covered by
test_strategies.py (checkpoint_save / checkpoint_resume) and test_torch_state_dict.py.
"""
import errno
import hashlib
import os

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
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


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, TINY["vocab"], (2, 8), generator=g)
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
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == on_disk[name] and entry["size"] == os.path.getsize(os.path.join(path, name))
    assert manifest["version"] == 1 and manifest["world_size"] == world

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
    from megatron_fsdp_ext.dcp_flat import quiet

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
