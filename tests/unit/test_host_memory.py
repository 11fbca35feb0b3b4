"""Host buffers for offload (csrc/host_memory.h): exact sizes, and pinning refused by
name where no CUDA device exists (the GPU suite checks the pinned ones)."""
import pytest
import torch

from megatron_fsdp_ext import _C


def test_unpinned_host_buffer():
    t = _C.empty_host(1001, torch.bfloat16, False)
    assert t.shape == (1001,) and t.dtype == torch.bfloat16 and t.device.type == "cpu" and not t.is_pinned()
    assert _C.empty_host(0, torch.float32, True).numel() == 0  # nothing to pin


@pytest.mark.skipif(_C.can_pin_host_memory(), reason="this process can pin: the GPU suite checks pinned buffers")
def test_pinning_without_cuda_names_the_problem():
    with pytest.raises(ValueError, match="pinned host memory needs CUDA .* pin_memory=False"):
        _C.empty_host(16, torch.float32, True)
    with pytest.raises(ValueError, match="negative size"):
        _C.empty_host(-1, torch.float32, False)
