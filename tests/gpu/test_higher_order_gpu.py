"""A gradient penalty (autograd.grad with create_graph=True, then backward through both
graphs) with CUDA tensors under stream chaos, against one plain process: the held units'
gathered parameters stay alive for the penalty's graph and reduce after its gradients
landed (tests/harness/higher_order_workers.py)."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import higher_order_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.mark.parametrize("mode", ["per_unit", "bucketed", "forward_after"])
def test_gradient_penalty_under_stream_chaos_gpu(mode):
    assert run_distributed(w.gradient_penalty, WORLD, mode, True, **GPU, timeout=240) == [True] * WORLD
