"""Post-accumulate-grad hooks with CUDA tensors on the GPU suite's backend, under stream
chaos: the hooks run on the reduce-scatter stream after the gradient landed, and the end
of backward waits for what they launched (an optimizer step writing the shards the next
forward gathers). A hook run on the compute stream without a wait, or a done event not
recorded after the hooks, reads or gathers stale values and fails the comparison."""
import pytest

from harness import grad_hook_workers as w
from harness import gpu_launch, gpu_world, run_distributed

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.mark.parametrize("mode", ["per_unit", "bucketed", "accumulate"])
def test_optimizer_in_backward_under_stream_chaos_gpu(mode):
    run_distributed(w.optimizer_in_backward, WORLD, mode, True, **GPU, timeout=240)
