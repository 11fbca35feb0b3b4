"""module.cpu() / module.to("cuda") after fully_shard with CUDA tensors (verl's and
NeMo-RL's parking of the model between rollout and update): the shards leave the GPU
(the allocator's bytes fall by at least this rank's shard), a forward while parked
raises naming the move back, and training continues as one plain process."""
import pytest

from harness import device_move_workers as w
from harness import gpu_launch, gpu_world, run_distributed

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.mark.parametrize("strategy,spelling,keep_grads", [
    ("optim_grads_params", "verl", False), ("optim_grads_params", "verl", True), ("optim_grads", "verl", True),
    ("no_shard", "verl", True), ("optim_grads_params", "nemo_rl", False), ("optim_grads_params", "swap", True), ("optim_grads", "per_param", False)])
def test_park_on_host_and_resume_gpu(strategy, spelling, keep_grads):
    results = run_distributed(w.park_and_resume, WORLD, strategy, spelling, keep_grads, **GPU, timeout=240)
    assert all(r["moved_bytes"] > 0 for r in results), results


def test_device_moves_refused_gpu():
    run_distributed(w.moves_refused, WORLD, **GPU, timeout=240)


def test_park_with_an_offloaded_unit_after_a_forward_without_backward_gpu():
    run_distributed(w.park_edge_cases, WORLD, **GPU, timeout=240)
