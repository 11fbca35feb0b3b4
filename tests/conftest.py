import pytest
import torch

from megatron_fsdp_ext.testing import gpu_world


def pytest_collection_modifyitems(config, items):
    world = gpu_world()  # MFSDP_GPU_WORLD: run the NCCL suite on that many GPUs
    have_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    skip = pytest.mark.skip(reason=f"needs {world} CUDA GPUs with NCCL")
    for item in items:
        if "gpu" in item.keywords and not have_gpus:
            item.add_marker(skip)
