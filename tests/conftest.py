import os

import pytest
import torch

from harness import gpu_backend, gpu_world, gpus_needed

# Set by tests/gpu/run_all.sh: on a GPU machine a `gpu` test that does not run is a
# failure, never a skip, so a run on too few GPUs cannot pass empty.
REQUIRE_GPU_ENV = "MFSDP_REQUIRE_GPU"
# The skip reason of an NCCL-only test under another backend: reported, not a failure.
NCCL_ONLY_SKIP = "NCCL-only behaviour"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "nccl_only: a gpu test of what only NCCL does (device-stream collectives: overlap in traces, "
        "CUDA-graph capture, no host synchronization); skipped, and reported, when MFSDP_GPU_BACKEND is gloo")
    config.addinivalue_line(
        "markers", "dtensor_collectives: a gpu test that gathers DTensors (FSDP2's, or state dicts' full_tensor) or "
        "runs torch's batched p2p: with CUDA tensors on Gloo, torch's functional collectives segfault and its batched "
        "p2p loses peers, so it runs in the NCCL suite only (skipped, and reported, on Gloo)")
    config.addinivalue_line(
        "markers", "gpu_exclusive: a timing measurement; tests/gpu/run_all.sh runs it after the parallel GPU tests, "
        "with the GPUs to itself")
    config.addinivalue_line(
        "markers", "gpu_world(n, ...): a gpu test whose mesh exists only at these MFSDP_GPU_WORLD values (a "
        "(pp 2, dp 2) pipeline, a 2-D mesh); at another world it is deselected, not skipped, so a run that "
        "requires every gpu test to run still passes there, and at its world it must run")
    config.addinivalue_line(
        "markers", "long_gpu: a gpu test that takes tens of seconds; tests/gpu/conftest.py starts these first, so the "
        "parallel stage does not end waiting on one long test started last")


def _gpus_found() -> int:
    # MFSDP_TEST_GPU_COUNT: tests/unit/test_gpu_run_guard.py checks the collection rules
    # on a machine without GPUs.
    if os.environ.get("MFSDP_TEST_GPU_COUNT"):
        return int(os.environ["MFSDP_TEST_GPU_COUNT"])
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    # MFSDP_GPU_WORLD ranks on MFSDP_GPU_BACKEND: NCCL needs a GPU per rank, Gloo one GPU.
    world, backend, needed = gpu_world(), gpu_backend(), gpus_needed()
    other_world = [item for item in items if item.get_closest_marker("gpu_world")
                   and world not in item.get_closest_marker("gpu_world").args]
    if other_world:
        config.hook.pytest_deselected(items=other_world)
        items[:] = [item for item in items if item not in other_world]
    if getattr(config, "workerinput", {}).get("workercount", 1) > 1:  # an xdist worker beside others
        # A timing measurement is only valid with the GPUs to itself: never beside other
        # tests (tests/gpu/run_all.sh runs these in a stage of their own, without xdist).
        alone = pytest.mark.skip(reason="gpu_exclusive: a timing test, not run beside other xdist workers; "
                                        "tests/gpu/run_all.sh runs it alone")
        for item in items:
            if "gpu_exclusive" in item.keywords:
                item.add_marker(alone)
    found = _gpus_found()
    if found < needed:
        skip = pytest.mark.skip(reason=f"needs {needed} CUDA GPUs for {world} ranks on {backend}, found {found}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    if backend != "nccl":
        skip = pytest.mark.skip(reason=f"{NCCL_ONLY_SKIP}: runs in the NCCL suite (MFSDP_GPU_BACKEND=nccl)")
        crash = pytest.mark.skip(reason=f"{NCCL_ONLY_SKIP}: torch's DTensor collectives and batched p2p crash "
                                        "with CUDA tensors on Gloo; runs in the NCCL suite")
        for item in items:
            if "nccl_only" in item.keywords:
                item.add_marker(skip)
            elif "dtensor_collectives" in item.keywords:
                item.add_marker(crash)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without xdist
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker per core, at most one per 4 GiB of
    memory (a worker's world-8 test holds eight ranks with torch loaded) and at most 8
    (the longest test files, not the workers, then bound the run)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, int(memory_gib // 4), 8))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and os.environ.get(REQUIRE_GPU_ENV) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(NCCL_ONLY_SKIP) and gpu_backend() != "nccl":
            return
        if hasattr(report, "wasxfail"):
            reason = f"xfail: {report.wasxfail}"
            del report.wasxfail
        report.outcome = "failed"
        report.longrepr = (f"{REQUIRE_GPU_ENV}=1: this gpu test did not run ({reason}); a GPU run must run "
                           f"every gpu test ({_gpus_found()} CUDA GPUs visible, MFSDP_GPU_WORLD={gpu_world()}, "
                           f"MFSDP_GPU_BACKEND={gpu_backend()})")
