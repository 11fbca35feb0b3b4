"""check_for_nan_in_grad on CUDA tensors: the fused device check on the reduce-scatter
stream, refused at optimizer.step() and clip_grad_norm_ on every rank (NCCL, or ranks
sharing a GPU over Gloo); unchanged training when gradients are finite."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import adversarial_workers as AW
from harness.workers import check_parity_results, train_parity

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)


@pytest.mark.parametrize("opts", [{}, {"gather_bucket_bytes": 1 << 30, "reduce_bucket_bytes": 1 << 30}],
                         ids=["per_unit", "buckets"])
def test_nan_check_refuses_the_step_on_cuda(opts):
    if WORLD < 2:
        pytest.skip("the planted NaN is on rank 1")
    run_distributed(AW.nan_check, WORLD, opts, **GPU, timeout=300)


def test_nan_check_changes_nothing_when_gradients_are_finite_on_cuda():
    results = run_distributed(train_parity, WORLD, {"check_for_nan_in_grad": True, "steps": 3}, **GPU, timeout=300)
    check_parity_results(results, steps=3)
