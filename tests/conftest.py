import os

import pytest
import torch

from harness import gpu_world

# Set by tests/gpu/run_all.sh: on a GPU machine a `gpu` test that does not run is a
# failure, never a skip, so a run on too few GPUs cannot pass empty.
REQUIRE_GPU_ENV = "MFSDP_REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_exclusive: a timing measurement; tests/gpu/run_all.sh runs it after the parallel GPU tests, "
        "with the GPUs to itself")


def _gpus_found() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    world = gpu_world()  # MFSDP_GPU_WORLD: run the NCCL suite on that many GPUs
    found = _gpus_found()
    if found >= world:
        return
    skip = pytest.mark.skip(reason=f"needs {world} CUDA GPUs with NCCL, found {found}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and os.environ.get(REQUIRE_GPU_ENV) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if hasattr(report, "wasxfail"):
            reason = f"xfail: {report.wasxfail}"
            del report.wasxfail
        report.outcome = "failed"
        report.longrepr = (f"{REQUIRE_GPU_ENV}=1: this gpu test did not run ({reason}); a GPU run must run "
                           f"every gpu test ({_gpus_found()} CUDA GPUs visible, MFSDP_GPU_WORLD={gpu_world()})")
