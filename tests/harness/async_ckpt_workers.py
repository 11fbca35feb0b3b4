"""Workers of tests/distributed/test_checkpoint_async.py: asynchronous saves, the waits
before the next save or load, failures and stalls in the write, stale temporaries."""
from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

import torch
import torch.distributed as dist

from megatron_fsdp_ext.dcp import AsyncSave, CheckpointError, load_checkpoint, save_checkpoint

from .workers import assert_same_snapshot as assert_same
from .workers import build_models, device_for_backend, expect_error, shard
from .workers import checkpoint_snapshot as snapshot

TINY = {"layers": 1, "d_model": 16, "ffn": 40, "vocab": 32}


def model_and_optimizer(seed=None, timeout=None, dims=None):
    _, model, _ = build_models(dims or TINY, device_for_backend())
    if seed is not None:  # another initialisation: a load must overwrite all of it
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    model = shard(model, {"timeout": timeout})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, TINY["vocab"], (2, 8), generator=g).to(device_for_backend())
    model.loss(tokens, tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loaded(path):
    """What a fresh model and optimizer hold after loading `path`."""
    fresh, fresh_opt = model_and_optimizer(seed=7)
    train_step(fresh, fresh_opt, 99)  # state of its own, to be replaced
    load_checkpoint(path, fresh, fresh_opt)
    return snapshot(fresh, fresh_opt)


def siblings(path):
    head, name = os.path.split(path)
    return sorted(n for n in os.listdir(head) if n.startswith(f".{name}.mfsdp-"))


@contextlib.contextmanager
def patched_item_write(replacement_for_rank):
    """DCP's per-item file write replaced on this rank by replacement_for_rank(rank,
    original) (None: kept), in every thread, until the block ends."""
    import torch.distributed.checkpoint.filesystem as fs

    original = fs._write_item
    replacement = replacement_for_rank(dist.get_rank(), original)
    if replacement is not None:
        fs._write_item = replacement
    try:
        yield
    finally:
        fs._write_item = original


def slow_writes(seconds_per_item):
    """Every rank's writes take a while: an asynchronous save is still writing when
    save_checkpoint has returned."""
    def make(rank, original):
        def slow(*args, **kwargs):
            time.sleep(seconds_per_item)
            return original(*args, **kwargs)
        return slow
    return make


def gated_writes(gate):
    """Every write waits until `gate` is set: the save is surely still writing while the
    test trains, however fast the disk and however slow the training. A write that is
    not in the background (the caller blocked on it) times out by name."""
    def make(rank, original):
        def gated(*args, **kwargs):
            if not gate.wait(timeout=60):
                raise TimeoutError("the checkpoint write waited 60 s for the test's gate: did the save run "
                                   "in the foreground?")
            return original(*args, **kwargs)
        return gated
    return make


def no_space_on(failing_rank):
    def make(rank, original):
        if rank != failing_rank:
            return None

        def no_space(transforms, stream, *args, **kwargs):
            stream.write(b"\0" * 7)  # a torn file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return no_space
    return make


def stall_on(stalled_rank, seconds):
    def make(rank, original):
        if rank != stalled_rank:
            return None
        stalled = []

        def stall(*args, **kwargs):
            if not stalled:  # once: a hung disk, then it recovers
                stalled.append(True)
                time.sleep(seconds)
            return original(*args, **kwargs)
        return stall
    return make


# ----------------------------------------------------------------------------- the workers

def async_save_keeps_values_at_save_time(rank, world, root):
    """Training right after an asynchronous save returns changes nothing in it: it holds
    exactly what a synchronous save of the same state holds (parameters and optimizer
    state, loaded into fresh models)."""
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    sync_path, async_path = os.path.join(root, "sync"), os.path.join(root, "async")
    save_checkpoint(sync_path, model, opt)
    at_save = snapshot(model, opt)
    gate = threading.Event()
    with patched_item_write(gated_writes(gate)):
        handle = save_checkpoint(async_path, model, opt, async_save=True)
        assert isinstance(handle, AsyncSave) and not handle.done(), "the save did not run in the background"
        for step in range(2):  # the parameters and optimizer state change while nothing is written yet
            train_step(model, opt, 1 + step)
        assert not handle.done()
        gate.set()
        handle.result(timeout=60)
    assert handle.done()
    after = snapshot(model, opt)
    assert not torch.equal(after[0]["norm.weight"], at_save[0]["norm.weight"])
    assert_same(loaded(async_path), loaded(sync_path), "the asynchronous checkpoint against the synchronous one")
    assert_same(loaded(async_path), at_save, "the asynchronous checkpoint against the state at save time")
    assert siblings(async_path) == [] and siblings(sync_path) == []
    return True


def next_save_and_load_wait(rank, world, root):
    """A save or load that follows an asynchronous save starts after it has finished: the
    previous save is done when the next call returns, and a load of the directory being
    written reads the new checkpoint."""
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    paths = {name: os.path.join(root, name) for name in ("a", "b", "c", "d")}
    with patched_item_write(slow_writes(0.02)):
        first = save_checkpoint(paths["a"], model, opt, async_save=True)
        assert not first.done()
        save_checkpoint(paths["b"], model, opt)  # synchronous, after the asynchronous one
        assert first.done(), "save_checkpoint did not wait for the asynchronous save before it"
        first.result()
        second = save_checkpoint(paths["c"], model, opt, async_save=True)
        third = save_checkpoint(paths["d"], model, opt, async_save=True)
        assert second.done(), "an asynchronous save did not wait for the one before it"
        at_save = snapshot(model, opt)
        assert not third.done()
        fresh, fresh_opt = model_and_optimizer(seed=7)
        load_checkpoint(paths["d"], fresh, fresh_opt)  # while it is still being written
        assert third.done(), "load_checkpoint did not wait for the asynchronous save"
    assert_same(snapshot(fresh, fresh_opt), at_save, "the checkpoint loaded while it was being written")
    assert_same(loaded(paths["a"]), at_save, "the asynchronous save the synchronous one waited for")
    return True


def failed_background_write(rank, world, path):
    """A write that fails on one rank in the background: result() raises on every rank,
    naming the rank; unreported, the next load raises it on every rank; the previous
    checkpoint stays loadable with exactly its values; no temporary directory is left."""
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    save_checkpoint(path, model, opt)
    before = snapshot(model, opt)
    train_step(model, opt, 1)
    with patched_item_write(no_space_on(1)):
        handle = save_checkpoint(path, model, opt, async_save=True)
        expect_error(lambda: handle.result(timeout=60), CheckpointError,
                     "writing the checkpoint failed on rank(s) [1]", "No space left on device",
                     f"the previous checkpoint at {path} is unchanged")
        unreported = save_checkpoint(path, model, opt, async_save=True)
        unreported._finished.wait(60)
    assert siblings(path) == [], f"a failed save left {siblings(path)}"
    fresh, fresh_opt = model_and_optimizer(seed=7)
    expect_error(lambda: load_checkpoint(path, fresh, fresh_opt), CheckpointError,
                 f"the previous asynchronous save_checkpoint({path}) failed", "failed on rank(s) [1]",
                 "No space left on device")
    assert_same(loaded(path), before, "the previous checkpoint after failed asynchronous saves")
    return True


def stale_temporaries_removed(rank, world, root):
    """A save removes the temporary directories a killed save left next to its target,
    and nothing else: not another target's, not a previous checkpoint moved aside."""
    path = os.path.join(root, "ckpt")
    stale = os.path.join(root, ".ckpt.mfsdp-tmp-0123456789abcdef")
    kept = [os.path.join(root, ".ckpt.mfsdp-old-0123456789abcdef"), os.path.join(root, ".other.mfsdp-tmp-01234567")]
    if rank == 0:
        for where in [stale] + kept:
            os.makedirs(where)
            with open(os.path.join(where, "__1_0.distcp"), "wb") as f:
                f.write(b"torn")
    dist.barrier()
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    save_checkpoint(path, model, opt, async_save=True).result(timeout=60)
    assert not os.path.exists(stale), "the killed save's temporary directory was not removed"
    assert all(os.path.isdir(k) for k in kept), "a save removed a directory that is not its stale temporary"
    return True


def stalled_write_times_out(rank, world, path, stalled_rank, timeout_s, async_save):
    """A rank stalled in its write holds the others no longer than the checkpoint timeout
    (the units' fully_shard timeout): they raise a CheckpointError naming it, and so does
    the stalled rank once it wakes. The previous checkpoint stays loadable, and the next
    save removes what the stalled rank left behind."""
    model, opt = model_and_optimizer(timeout=timeout_s)
    train_step(model, opt, 0)
    save_checkpoint(path, model, opt)
    before = snapshot(model, opt)
    train_step(model, opt, 1)
    # Past the longest wait of any other rank (the timeout, and the grace of those that
    # wait for rank 0): the stalled rank wakes to a decided failure.
    stall_s = 2 * timeout_s + 0.5
    start = time.monotonic()
    with patched_item_write(stall_on(stalled_rank, stall_s)):
        def save():
            handle = save_checkpoint(path, model, opt, async_save=async_save)
            if handle is not None:
                handle.result()
        expect_error(save, CheckpointError, f"writing the checkpoint failed on rank(s) [{stalled_rank}]",
                     f"checkpoint timeout of {timeout_s:g} s", "stalled", f"the previous checkpoint at {path} is unchanged")
    elapsed = time.monotonic() - start
    if rank != stalled_rank:
        # The timeout, the grace of the ranks that wait for rank 0, and the save's own work.
        assert elapsed < timeout_s + 1.0 + 2.0, f"rank {rank} raised after {elapsed:.1f}s (timeout {timeout_s}s)"
    else:
        assert elapsed >= stall_s
    dist.barrier()
    assert_same(loaded(path), before, "the previous checkpoint after a stalled save")
    save_checkpoint(path, model, opt)
    assert siblings(path) == [], f"the stalled save left {siblings(path)}"
    assert_same(loaded(path), snapshot(model, opt), "the next save")
    return elapsed


def staging_is_pinned_and_reused(rank, world, root):
    """On CUDA the asynchronous save copies into one page-locked arena: every staged CUDA
    tensor is pinned, the second save of the same shapes reuses the arena (no pinning
    again), and the values loaded back are those at save time."""
    from megatron_fsdp_ext.checkpoint import writer as cw
    from megatron_fsdp_ext import dcp
    model, opt = model_and_optimizer()
    train_step(model, opt, 0)
    staged = []
    original = dcp.stage_on_host

    def spy(state_dict):
        out = original(state_dict)
        staged.append(out)
        return out

    dcp.stage_on_host = spy
    try:
        at_save = snapshot(model, opt)
        save_checkpoint(os.path.join(root, "a"), model, opt, async_save=True).result(timeout=120)
        arena = cw._staging._arena
        train_step(model, opt, 1)
        at_second = snapshot(model, opt)
        save_checkpoint(os.path.join(root, "b"), model, opt, async_save=True).result(timeout=120)
        assert cw._staging._arena is arena and arena is not None, "the second save pinned a new arena"
    finally:
        dcp.stage_on_host = original
    cuda_staged = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            cuda_staged.append(local)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(staged[-1])
    base = arena.base
    in_arena = [t for t in cuda_staged if base.data_ptr() <= t.data_ptr() < base.data_ptr() + base.numel()]
    assert len(in_arena) >= len(list(model.parameters())), (len(in_arena), len(cuda_staged))
    assert all(t.is_pinned() for t in in_arena), "a staged tensor is not page-locked"
    assert_same(loaded(os.path.join(root, "a")), at_save, "the first asynchronous checkpoint")
    assert_same(loaded(os.path.join(root, "b")), at_second, "the second, through the reused arena")
    cw.release_async_save_buffers()
    assert cw._staging._arena is None
    return True
