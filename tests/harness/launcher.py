"""Run a function on N local processes with a process group, fail loudly on timeout."""
from __future__ import annotations

import datetime
import faulthandler
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import gloo_threads


class DistributedTestError(AssertionError):
    pass


# Ranks fork from one server process that imported torch and the library once
# (multiprocessing's forkserver), instead of each spawning a fresh interpreter: a world-2
# test then starts in about 0.6 s instead of 3.5 s on a 2-core machine. The server is
# started by exec, never forked from pytest, so it holds no CUDA or thread state.
# Settings read when a module is imported (TORCH_DISTRIBUTED_DEBUG, OpenMP variables) are
# those of the server's start; ranks end through os._exit (no atexit handlers).
_PRELOAD = ["torch", "torch.distributed", "megatron_fsdp_ext", "harness.workers"]
# On a CPU-only torch build (CI) torch._dynamo too: every rank that calls fully_shard
# imports it (core/hook_support.load_dynamo), about 0.75 s of each rank's start on a
# 2-core machine. Not on a CUDA build: the server must hold no CUDA state, and that import
# is not checked there. A test that needs the first import to happen in the rank passes
# fresh_interpreter=True to run_distributed.
# torch._inductor.compile_fx likewise (~1.1 s a rank): torchtitan's attention module calls
# torch.compile at import, as do the compile tests.
if not torch.backends.cuda.is_built():
    _PRELOAD[2:2] = ["torch._dynamo", "torch._inductor.compile_fx"]
    # The client libraries the interop tests run (Hugging Face, PEFT, Accelerate,
    # Lightning): 2-4 s of each such rank's start under load on a 2-core machine. A name
    # that does not import here is skipped by the server.
    _PRELOAD += ["transformers.models.llama.modeling_llama", "transformers.models.qwen3.modeling_qwen3", "peft",
                 "accelerate", "lightning.fabric", "lightning.pytorch", "safetensors.torch"]
_context = None


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
        # The server starts with `python -c` and does not take the caller's sys.path
        # (Python 3.11 ignores it; a failed preload is silent): tests/ goes on its
        # PYTHONPATH for the preload of harness.workers, for this start only.
        from multiprocessing import forkserver
        saved = os.environ.get("PYTHONPATH")
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, saved) if p)
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _context


def _entry(fn, rank, world_size, backend, device, init_file, timeout_s, args, kwargs, results, environ):
    try:
        # The server's environment is the one it started with: take the caller's current one.
        os.environ.clear()
        os.environ.update(environ)
        if device is not None:
            os.environ[TEST_DEVICE_ENV] = device  # workers.device_for_backend() reads it
        # A hung rank prints every thread's stack shortly before the launcher kills it; a
        # crashing one (SIGSEGV in a backend) prints its Python stack before it dies.
        faulthandler.enable(all_threads=True)
        faulthandler.dump_traceback_later(max(timeout_s - 10, 5), exit=False)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        torch.set_num_threads(1)
        gloo_threads.use_one_worker_thread()  # torch's two-thread Gloo groups race (gloo_threads.py)
        if backend == "nccl" or device == "cuda":
            # Ranks beyond the GPU count share GPUs (Gloo only: NCCL refuses duplicates).
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend == "fake":  # one process plays `rank` of world_size; nothing moves
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        else:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        try:
            out = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # Report before teardown: after a failure the other ranks may never reach the
            # barrier, and a destroy that waits on them would turn the error into a timeout.
            results.put((rank, False, traceback.format_exc()))
            _abandon_process_group(backend)
            return
        # No rank tears down while another still sets up a connection with it (Gloo's
        # connectFullMesh of a new group fails with "Connection closed by peer").
        dist.barrier(device_ids=[torch.cuda.current_device()] if backend == "nccl" else None)
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))


def _abandon_process_group(backend: str) -> None:
    """Tear down after a failure without waiting on peers: NCCL communicators are aborted
    (pending collectives are cancelled), Gloo groups are destroyed."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if backend == "nccl" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


# Set in each rank by run_distributed(device=...): the device its tensors live on.
TEST_DEVICE_ENV = "MFSDP_TEST_DEVICE"


def gpu_world() -> int:
    """World size of the GPU test suite: MFSDP_GPU_WORLD (default 2). 1 is for the
    single-GPU checks of tests/gpu/run_world1.sh; the suite needs >= 2."""
    value = os.environ.get("MFSDP_GPU_WORLD", "2")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MFSDP_GPU_WORLD must be a positive integer, got {value!r}")
    return int(value)


def gpu_backend() -> str:
    """Backend of the GPU test suite: MFSDP_GPU_BACKEND, "nccl" (default: one GPU per
    rank) or "gloo" (CUDA tensors over Gloo: every rank may share one GPU)."""
    value = os.environ.get("MFSDP_GPU_BACKEND", "nccl")
    if value not in ("nccl", "gloo"):
        raise ValueError(f"MFSDP_GPU_BACKEND must be 'nccl' or 'gloo', got {value!r}")
    return value


def gpus_needed() -> int:
    """GPUs the GPU suite needs: one per rank under NCCL, one in all under Gloo."""
    return gpu_world() if gpu_backend() == "nccl" else 1


def gpu_launch() -> dict:
    """run_distributed keyword arguments of the GPU suite: its backend, CUDA tensors."""
    return {"backend": gpu_backend(), "device": "cuda"}


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    device: Optional[str] = None,
    timeout: float = 180.0,
    simulate_rank: int = 0,
    fresh_interpreter: bool = False,
    **kwargs: Any,
) -> List[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` processes and return
    the per-rank results. `device`: where the ranks' tensors live ("cuda": each rank
    sets its CUDA device to rank % GPUs; default: cuda under NCCL, else the CPU).
    backend="fake": one process plays rank `simulate_rank` of `world_size` under torch's
    fake backend (collectives move nothing); the result is that rank's alone.
    Raises DistributedTestError with the failing rank's traceback, or when the
    processes do not finish within `timeout` seconds (they are killed: a hang never
    blocks the test suite).
    fresh_interpreter=True: each rank is a new interpreter (multiprocessing's spawn, ~3 s
    slower) that imported nothing of the server's preload (_PRELOAD)."""
    ctx = mp.get_context("spawn") if fresh_interpreter else _mp_context()
    where = f"world {world_size}, {backend}" + (f" with {device} tensors" if device else "")
    fd, init_file = tempfile.mkstemp(prefix="mfsdp_init_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    results = ctx.Queue()
    ranks = [simulate_rank] if backend == "fake" else list(range(world_size))
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, backend, device, init_file, timeout, args, kwargs, results, dict(os.environ)),
            daemon=True,
        )
        for r in ranks
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outputs, failures = {}, {}
    try:
        while len(outputs) + len(failures) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedTestError(
                    f"{fn.__name__} ({where}) timed out after {timeout:.0f}s; "
                    f"ranks finished: {sorted(outputs)}; failed: {sorted(failures)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in zip(ranks, procs) if not p.is_alive() and r not in outputs and r not in failures]
                exit_codes = {r: p.exitcode for r, p in zip(ranks, procs)}
                # A rank that died without reporting (segfault, abort) fails the test.
                if dead and all(exit_codes[r] not in (None, 0) for r in dead):
                    time.sleep(0.5)
                    if results.empty():
                        codes = {r: exit_codes[r] for r in dead}
                        raise DistributedTestError(
                            f"{fn.__name__} ({where}): ranks died without a result, "
                            f"exit codes {codes}"
                        )
                continue
            if ok:
                outputs[rank] = payload
            else:
                failures[rank] = payload
                # One failing rank usually leaves the others blocked in a collective.
                break
        if failures:
            rank = min(failures)
            raise DistributedTestError(
                f"{fn.__name__} ({where}) failed on rank {rank}:\n{failures[rank]}"
            )
        return [outputs[r] for r in ranks]
    finally:
        for p in procs:
            p.join(timeout=5 if not failures and len(outputs) == len(ranks) else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(init_file):
            os.unlink(init_file)


def run_script(nproc: int, script, *args: str, port: int, timeout: float = 300) -> str:
    """Run `script` under torchrun with `nproc` CPU ranks (OMP_NUM_THREADS=1); assert it
    exits 0 (showing the tail of its output if not) and return its stdout."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    # torchrun without --log-dir makes a torchelastic_* directory in /tmp and never removes it.
    with tempfile.TemporaryDirectory(prefix="mfsdp_torchrun_") as log_dir:
        cmd = [sys.executable, "-P", "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}", f"--log-dir={log_dir}", str(script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
