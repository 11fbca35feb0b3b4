import pytest
import torch


def pytest_collection_modifyitems(config, items):
    have_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    skip = pytest.mark.skip(reason="needs 2 CUDA GPUs with NCCL")
    for item in items:
        if "gpu" in item.keywords and not have_gpus:
            item.add_marker(skip)
