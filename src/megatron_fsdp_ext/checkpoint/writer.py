"""Writing a checkpoint directory, on the caller's thread or in the background: the
part of save_checkpoint after the state dict is made.

The ranks write through DCP's planner and file writer, but meet through the job's c10d
store (Meeting), never through a process group:

* a save running in the background issues no collective, so nothing it does can pair
  with, or wait behind, the training's collectives on any group;
* every wait has a deadline, the checkpoint timeout (the module's units' collective
  timeout, fully_shard(timeout=...), else the default group's): a rank stalled in its
  write holds the others at most that long, and they raise a CheckpointError naming it;
* one store key per save (its outcome) is decided once, by compare-and-set: rank 0 sets
  it to "publishing" before it swaps the directory in, a rank that gave up waiting sets
  it to the failure. Whichever comes first holds, so no rank reports success while
  another reports failure.

Two rounds: every rank posts its local plan, rank 0 makes the global plan (and DCP's
metadata) and posts each rank its part; every rank writes and hashes its files and posts
the results, rank 0 writes .metadata, claims the outcome and publishes
(files.publish). Any failure is sent to rank 0, which removes the temporary
directory and decides the outcome; every rank raises the same message.

An asynchronous save first copies the state dict's tensors to host memory (HostStaging;
pinned when they are on CUDA), so training may change the parameters as soon as
save_checkpoint returns; the rounds then run on a thread (AsyncSave). The next save or
load waits for it first and raises its failure if .result() did not.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import pickle
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from ..core.agree import describe, listing
from .files import (WRITER, CheckpointError, data_file_records, moved_aside, publish, whole_file_record)
from .dcp_flat import quiet
from ..core.param_index import iter_states
from ..core.dtensor_face import is_dtensor

# torch's default collective timeout (Gloo's; NCCL's is shorter), for a job whose groups
# do not say theirs.
_DEFAULT_TIMEOUT_S = 1800.0
_STORE_PREFIX = "mfsdp_checkpoint"
_OUTCOME = "outcome"
_PUBLISHING, _PUBLISHED, _FAILED = b"publishing", b"published", b"failed\n"
_PLANNING, _WRITING, _PUBLISHING_STAGE = "planning the checkpoint", "writing the checkpoint", "publishing the checkpoint"


# ----------------------------------------------------------------------------- the timeout

def _group_timeout(group) -> Optional[float]:
    """Seconds a collective of `group` waits before failing, as its backend was created."""
    for device_type in getattr(group, "_device_types", [torch.device("cpu")]):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def checkpoint_timeout(module: nn.Module) -> float:
    """How long a save waits for any rank: the shortest collective timeout of the module's
    units (their groups are created with fully_shard(timeout=...)), else the default
    group's."""
    found = [t for state in iter_states(module) if state.unit is not None
             for t in [_group_timeout(state.check_group)] if t]
    if not found and dist.is_available() and dist.is_initialized():
        default = _group_timeout(dist.distributed_c10d._get_default_group())
        found = [default] if default else []
    return min(found) if found else _DEFAULT_TIMEOUT_S


# ----------------------------------------------------------------------------- staging

def _aligned(nbytes: int) -> int:
    return (nbytes + _ARENA_ALIGN - 1) // _ARENA_ALIGN * _ARENA_ALIGN


_ARENA_ALIGN = 64  # bytes: every view starts aligned for any dtype
# Threads that fault in a new arena's pages before it is page-locked (first touch is
# what makes pinning slow; the kernel takes faults on several cores at once).
_TOUCH_THREADS = max(1, min(8, os.cpu_count() or 1))
_TOUCH_CHUNK = 64 << 20


class PinnedArena:
    """One host allocation for all of a save's CUDA tensors, page-locked once with
    cudaHostRegister at its exact size (torch's pinned allocator rounds every tensor up
    to a power of two and pins each on its own), its pages first touched by several
    threads. Tensors are views of it; close() unregisters it."""

    def __init__(self, nbytes: int) -> None:
        self.base = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        chunks = list(self.base.split(_TOUCH_CHUNK))
        if len(chunks) > 1 and _TOUCH_THREADS > 1:
            with ThreadPoolExecutor(max_workers=_TOUCH_THREADS, thread_name_prefix="mfsdp-touch") as pool:
                list(pool.map(lambda c: c.fill_(0), chunks))  # fill_ releases the GIL
        else:
            self.base.fill_(0)
        error = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), self.base.numel(), 0)
        if int(error) != 0:
            raise CheckpointError(f"save_checkpoint: page-locking {self.base.numel()} bytes of host memory for "
                                  f"the asynchronous save's copy failed (cudaHostRegister: {error})")
        self._registered = True
        self._used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        view = self.base[self._used: self._used + nbytes].view(dtype).view(shape)
        self._used += _aligned(nbytes)
        return view

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self._registered = False


class HostStaging:
    """Host copies of a state dict's tensors, taken on the caller's thread so that the
    background write reads values that training no longer changes. DTensors keep their
    placement (their local shard copied, their mesh and layout as they were), everything
    else is deep-copied. The buffers are kept for the next save of the same shapes:
    pinning host memory costs far more than the copy into it; release() frees them.
    CUDA tensors are copied into one PinnedArena (laid out again when a tensor's shape
    or dtype changes), CPU tensors into buffers of their own."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple, torch.Tensor] = {}
        self._arena: Optional[PinnedArena] = None
        self._arena_layout: Optional[List[Tuple]] = None

    def stage(self, tree):
        self._prepare_arena(tree)
        cuda_devices: set = set()
        used: set = set()
        staged = self._copy(tree, (), cuda_devices, used)
        for device in cuda_devices:  # the copies were queued without blocking
            torch.cuda.synchronize(device)
        for path in [p for p in self._buffers if p not in used]:  # a tensor gone since the last save
            del self._buffers[path]
        return staged

    def release(self) -> None:
        self._buffers.clear()
        if self._arena is not None:
            self._arena.close()
        self._arena, self._arena_layout = None, None

    def _prepare_arena(self, tree) -> None:
        """Lay out (or keep) the arena for the CUDA tensors of `tree`."""
        layout: List[Tuple] = []
        self._cuda_tensors(tree, (), layout)
        if layout == self._arena_layout:
            return
        for path, _, _ in self._arena_layout or ():
            self._buffers.pop(path, None)
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._arena_layout = layout
        if layout:
            self._arena = PinnedArena(sum(_aligned(math.prod(shape) * dtype.itemsize) for _, shape, dtype in layout))
            for path, shape, dtype in layout:
                self._buffers[path] = self._arena.take(shape, dtype)

    def _cuda_tensors(self, value, path: Tuple, out: List[Tuple]) -> None:
        if is_dtensor(value):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            if value.device.type == "cuda":
                out.append((path, tuple(value.shape), value.dtype))
        elif isinstance(value, dict):
            for k, v in value.items():
                self._cuda_tensors(v, path + (k,), out)
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                self._cuda_tensors(v, path + (i,), out)

    def _copy(self, value, path: Tuple, cuda_devices: set, used: set):
        if is_dtensor(value):
            local = self._tensor(value.to_local().detach(), path, cuda_devices, used)
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), path, cuda_devices, used)
        if isinstance(value, dict):
            return {k: self._copy(v, path + (k,), cuda_devices, used) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._copy(v, path + (i,), cuda_devices, used) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, source: torch.Tensor, path: Tuple, cuda_devices: set, used: set) -> torch.Tensor:
        on_cuda = source.device.type == "cuda"
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if on_cuda:  # the arena was laid out from this very tree
                raise AssertionError(f"no staging buffer for CUDA tensor at {path}")
            buffer = torch.empty(source.shape, dtype=source.dtype)
            self._buffers[path] = buffer
        used.add(path)
        buffer.copy_(source, non_blocking=on_cuda)
        if on_cuda:
            cuda_devices.add(source.device)
        return buffer


_staging = HostStaging()


def stage_on_host(state_dict: dict) -> dict:
    return _staging.stage(state_dict)


def release_async_save_buffers() -> None:
    """Free the host memory asynchronous saves keep for their copies of the state (the
    next asynchronous save allocates, and pins, it again). Waits for a save in flight."""
    handle = _in_flight
    if handle is not None:
        handle._finished.wait()
    _staging.release()


# ----------------------------------------------------------------------------- meeting

def _job_store():
    """The c10d store the job's ranks rendezvoused through."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint: the process group's store is not reachable ({describe(e)}); "
                              "a save needs it to coordinate the ranks") from e


@dataclasses.dataclass(frozen=True)
class SaveJob:
    """One save, as every rank sees it (token and paths agreed before any write)."""
    what: str            # "save_checkpoint(<path>)", how errors name the call
    target: str          # the checkpoint directory (absolute)
    tmp: str             # the sibling directory written first
    token: str           # unique per save, the same on every rank
    rank: int
    world: int
    timeout_s: float     # the longest any rank waits for another
    write_threads: int   # files (and writer threads) per rank

    def failure(self, stage: str, failed: Dict[int, str]) -> str:
        kept = (f"the previous checkpoint at {self.target} is unchanged" if os.path.isdir(self.target)
                else f"nothing was written to {self.target}{moved_aside(self.target)}")
        return f"{self.what}: {stage} failed on rank(s) {sorted(failed)} ({listing(failed)}); {kept}"

    def stalled(self) -> str:
        return f"no word within the checkpoint timeout of {self.timeout_s:g} s: stalled or died"


class Meeting:
    """The ranks of one save meeting through store keys under the save's token:
    '<phase>/<rank>' holds a rank's part of a phase, pickled as (failure or None, value);
    'outcome' the decision (module docstring). A world of one meets in a store of its own."""

    def __init__(self, job: SaveJob):
        self.job = job
        if job.world > 1:
            self.store = dist.PrefixStore(f"{_STORE_PREFIX}/{job.token}/", _job_store())
        else:
            self.store = dist.HashStore()
        # Others wait a little longer than rank 0, whose own wait starts after its write:
        # the failure rank 0 decides (naming the stalled rank) reaches them first.
        self.grace_s = max(1.0, 0.1 * job.timeout_s)

    # -- posting and reading
    def send(self, phase: str, value: Any = None, failure: Optional[BaseException] = None) -> None:
        part = (describe(failure), None) if failure is not None else (None, value)
        self.store.set(f"{phase}/{self.job.rank}", pickle.dumps(part))

    def post(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def _read(self, key: str):
        return pickle.loads(self.store.get(key))

    def _outcome(self) -> Optional[bytes]:
        return self.store.get(_OUTCOME) if self.store.check([_OUTCOME]) else None

    def _missing(self, phase: str) -> List[int]:
        return [r for r in range(self.job.world) if not self.store.check([f"{phase}/{r}"])]

    @staticmethod
    def _poll(ready: Callable[[], Any], deadline: float):
        pause = 0.002
        while True:
            got = ready()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, 0.05)

    def _raise_failed(self, outcome: Optional[bytes], cause: Optional[BaseException]) -> None:
        if outcome is not None and outcome.startswith(_FAILED):
            if self.job.rank == 0:
                shutil.rmtree(self.job.tmp, ignore_errors=True)
            raise CheckpointError(outcome[len(_FAILED):].decode()) from cause

    # -- rank 0
    def collect(self, phase: str, stage: str, cause: Optional[BaseException]) -> Dict[int, Any]:
        """Rank 0: every rank's part of `phase` (failing the save if any rank failed, or
        posted nothing within the timeout)."""
        keys = [f"{phase}/{r}" for r in range(self.job.world)]

        def ready():
            self._raise_failed(self._outcome(), cause)
            return True if self.store.check(keys) else None

        if self._poll(ready, time.monotonic() + self.job.timeout_s) is None:
            self.fail(stage, {r: self.job.stalled() for r in self._missing(phase)}, cause)
        parts = {r: self._read(k) for r, k in enumerate(keys)}
        failed = {r: failure for r, (failure, _) in parts.items() if failure is not None}
        if failed:
            self.fail(stage, failed, cause)
        return {r: value for r, (_, value) in parts.items()}

    def _decide_failed(self, stage: str, failed: Dict[int, str]) -> bytes:
        """Set the outcome to this failure unless it is decided already; the outcome."""
        message = self.job.failure(stage, failed)
        if self.job.rank == 0:  # gone before any rank hears of the failure
            shutil.rmtree(self.job.tmp, ignore_errors=True)
        return self.store.compare_set(_OUTCOME, "", _FAILED + message.encode())

    def fail(self, stage: str, failed: Dict[int, str], cause: Optional[BaseException]):
        """Rank 0: decide the save failed (unless a rank that gave up decided first), raise."""
        decided = self._decide_failed(stage, failed)
        self._raise_failed(decided, cause)
        # Only rank 0 claims the outcome for publishing, and it fails nothing after that.
        raise CheckpointError(f"{self.job.what}: {stage} failed ({listing(failed)}) after the outcome was "
                              f"{decided!r}; {self.job.target} holds the new or the previous checkpoint") from cause

    def publish(self, swap: Callable[[], None]) -> None:
        """Rank 0: claim the outcome, then swap the directory in; the others hear how it went."""
        decided = self.store.compare_set(_OUTCOME, "", _PUBLISHING)
        self._raise_failed(decided, None)
        try:
            swap()
        except Exception as e:
            shutil.rmtree(self.job.tmp, ignore_errors=True)
            message = self.job.failure(_PUBLISHING_STAGE, {0: describe(e)})
            self.store.set(_OUTCOME, _FAILED + message.encode())
            raise CheckpointError(message) from e
        self.store.set(_OUTCOME, _PUBLISHED)

    # -- every other rank
    def hear(self, phase: str, stage: str, cause: Optional[BaseException], key: Optional[str] = None):
        """Wait for rank 0: the value at `key`, or (key None) the published outcome. On the
        deadline, the ranks that did not post their part of `phase` (else rank 0) are
        named as stalled, and the save is decided failed unless rank 0 claimed it for
        publishing first (then the swap, a few renames, gets one more timeout)."""
        def ready():
            outcome = self._outcome()
            self._raise_failed(outcome, cause)
            if key is None and outcome == _PUBLISHED:
                return ("published", None)
            if key is not None and self.store.check([key]):
                return ("value", self._read(key))
            return None

        got = self._poll(ready, time.monotonic() + self.job.timeout_s + self.grace_s)
        if got is None:
            decided = self._decide_failed(stage, {r: self.job.stalled() for r in self._missing(phase) or [0]})
            self._raise_failed(decided, cause)
            got = self._poll(ready, time.monotonic() + self.job.timeout_s)  # rank 0 is publishing
        if got is None:
            raise CheckpointError(f"{self.job.what}: rank 0 began swapping in the new checkpoint but did not report "
                                  f"within {self.job.timeout_s:g} s; {self.job.target} holds the new or the previous "
                                  "checkpoint") from cause
        return got[1]

    def keys(self) -> List[str]:
        phases = ("plan", "global", "written")
        return [_OUTCOME] + [f"{p}/{r}" for p in phases for r in range(self.job.world)]


# Rank 0 deletes a save's keys once every rank has begun the next save (and so finished
# this one): deleting them earlier could hide a verdict from a rank still reading.
_previous_meeting: Optional[Meeting] = None


def _forget_previous_meeting() -> None:
    global _previous_meeting
    done, _previous_meeting = _previous_meeting, None
    if done is None or done.job.world == 1:
        return
    for key in done.keys():
        try:
            done.store.delete_key(key)
        except (RuntimeError, ValueError):
            pass  # a key that was never set


# ----------------------------------------------------------------------------- writing

def _local_plan(job: SaveJob, state_dict: dict):
    planner = DefaultSavePlanner()
    writer = FileSystemWriter(job.tmp, thread_count=job.write_threads)
    planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(), is_coordinator=job.rank == 0)
    if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
        writer.set_up_storage_writer(job.rank == 0, rank=job.rank, use_collectives=True)
    else:
        writer.set_up_storage_writer(job.rank == 0)
    return planner, writer, writer.prepare_local_plan(planner.create_local_plan())


def _own_files(job: SaveJob) -> List[str]:
    """The data files this rank's writer made (DCP names them __<rank>_<i>.distcp)."""
    return sorted(n for n in os.listdir(job.tmp)
                  if (m := WRITER.match(n)) is not None and int(m.group(1)) == job.rank)


def write_and_publish(job: SaveJob, state_dict: dict) -> None:
    """Write `state_dict` into job.tmp on every rank, hash it, and have rank 0 publish it
    at job.target (module docstring). Raises CheckpointError, with the same message on
    every rank, when any rank failed or stalled; the previous checkpoint is then as it was."""
    if job.rank == 0:
        _forget_previous_meeting()
    meeting = Meeting(job)
    coordinator = job.rank == 0
    try:
        _rounds(job, meeting, state_dict, coordinator)
    finally:
        if coordinator:
            global _previous_meeting
            _previous_meeting = meeting


def _rounds(job: SaveJob, meeting: Meeting, state_dict: dict, coordinator: bool) -> None:
    # Round 1: local plans in, each rank's part of the global plan out.
    own: Optional[BaseException] = None
    planner = writer = None
    try:
        with quiet():
            planner, writer, plan = _local_plan(job, state_dict)
        meeting.send("plan", plan)
    except Exception as e:
        own = e
        meeting.send("plan", failure=e)
    metadata = None
    if coordinator:
        plans = meeting.collect("plan", _PLANNING, own)
        try:
            with quiet():
                global_plans, metadata = planner.create_global_plan([plans[r] for r in range(job.world)])
                global_plans = writer.prepare_global_plan(global_plans)
        except Exception as e:
            meeting.fail(_PLANNING, {0: describe(e)}, e)
        for r, part in enumerate(global_plans):
            meeting.post(f"global/{r}", part)
    mine = meeting.hear("plan", _PLANNING, own, key=f"global/{job.rank}")

    # Round 2: write and hash, results in; rank 0 writes .metadata and publishes.
    written = None
    try:
        with quiet():
            results = writer.write_data(planner.finish_plan(mine), planner)
            results.wait()
            results = results.value()
        # The manifest's records of this rank's files: each entry's byte range hashed
        # (what a load checks as it reads), the gaps between them too.
        entries: Dict[str, List[Tuple[int, int]]] = {n: [] for n in _own_files(job)}
        for result in results:
            info = result.storage_data
            if info.relative_path not in entries:
                raise CheckpointError(f"{job.what}: DCP reports entry '{result.index.fqn}' in "
                                      f"{info.relative_path!r}, which is not a file this rank wrote")
            entries[info.relative_path].append((info.offset, info.length))
        written = (results, data_file_records(job.tmp, entries, job.write_threads))
        meeting.send("written", written)
    except Exception as e:
        own = e
        meeting.send("written", failure=e)
    if not coordinator:
        meeting.hear("written", _WRITING, own)
        return
    parts = meeting.collect("written", _WRITING, own)
    try:
        writer.finish(metadata=metadata, results=[parts[r][0] for r in range(job.world)])
        files: Dict[str, dict] = {}
        for _, records in parts.values():
            files.update(records)
        files[".metadata"] = whole_file_record(os.path.join(job.tmp, ".metadata"))
    except Exception as e:
        meeting.fail(_WRITING, {0: describe(e)}, e)
    meeting.publish(lambda: publish(job.target, job.tmp, job.token, files, job.world))


# ----------------------------------------------------------------------------- in the background

class AsyncSave:
    """A save_checkpoint(..., async_save=True) under way: its state was copied when the
    call returned; the files are written and published on a background thread.

    result(timeout=None) waits for it and raises its CheckpointError (the same on every
    rank: a failed or stalled write on any rank, or a failed publish; the previous
    checkpoint is then unchanged); with a timeout (seconds) it raises TimeoutError if the
    save is still running then (it goes on). done() tells whether it has finished. The
    next save_checkpoint or load_checkpoint waits for it, and raises its failure if no
    result() call has."""

    def __init__(self, job: SaveJob):
        self.path = job.target
        self._job = job
        self._finished = threading.Event()
        self._error: Optional[BaseException] = None
        self._seen = False

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: Optional[float] = None) -> None:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self._job.what}: still writing after {timeout:g} s")
        self._seen = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error is not None else "done")
        return f"AsyncSave({self.path!r}, {state})"


_in_flight: Optional[AsyncSave] = None


def start_async_save(job: SaveJob, staged: dict) -> AsyncSave:
    """Run write_and_publish(job, staged) on a thread; the handle reports how it went."""
    global _in_flight
    handle = AsyncSave(job)

    def run() -> None:
        try:
            write_and_publish(job, staged)
        except CheckpointError as e:
            handle._error = e
        except BaseException as e:  # a bug, not a checkpoint failure: still never silent
            error = CheckpointError(f"{job.what}: the background write failed ({describe(e)})")
            error.__cause__ = e
            handle._error = error
        finally:
            handle._finished.set()

    # Not a daemon: an interpreter that exits waits for the save (every wait is bounded).
    thread = threading.Thread(target=run, name=f"mfsdp-checkpoint-{job.token}", daemon=False)
    _in_flight = handle
    thread.start()
    return handle


def wait_for_previous_save(what: str) -> Optional[BaseException]:
    """Wait for this process's asynchronous save still in flight, if any. Returns its
    failure when no result() call has reported it (a CheckpointError for `what` to
    raise), else None."""
    global _in_flight
    handle = _in_flight
    if handle is None:
        return None
    handle._finished.wait()  # every wait inside is bounded by the checkpoint timeout
    _in_flight = None
    if handle._error is None or handle._seen:
        return None
    handle._seen = True
    error = CheckpointError(f"{what}: the previous asynchronous {handle._job.what} failed, and no result() call "
                            f"reported it: {handle._error}")
    error.__cause__ = handle._error
    return error


def temporaries_in_use() -> List[str]:
    handle = _in_flight
    return [handle._job.tmp] if handle is not None and not handle.done() else []
