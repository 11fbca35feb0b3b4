"""reshard_after_forward=int with CUDA tensors on the GPU suite's backend: the kept copy is
made and gathered on the unit's streams; training equals ours with True bit for bit, and
FSDP2's with the same int under NCCL (torch's own collectives lack CUDA tensors over Gloo).
A world of 4 or more: the int is a factor of the group strictly between 1 and its size."""
import pytest

from harness import gpu_backend, gpu_launch, gpu_world, run_distributed
from harness import post_forward_workers as w

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_world(4, 6, 8)]
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 30])
def test_reshard_after_forward_int_gpu(bucket_bytes):
    n = 2 if WORLD % 2 == 0 else 3
    assert all(run_distributed(w.trains_like_fsdp2_and_like_true, WORLD, n, bucket_bytes=bucket_bytes,
                               with_fsdp2=gpu_backend() == "nccl", **GPU, timeout=240))
