"""module.cpu() / module.to(device) after fully_shard (RL trainers park the sharded model in
host memory between phases): training continues as one plain process that never moved,
for every strategy, with the model parked before or after its gradients were reduced;
moves a unit cannot take are refused by name. The GPU suite runs the same workers with
CUDA tensors (tests/gpu/test_device_moves_gpu.py), where the shards really leave the GPU."""
import pytest

from harness import device_move_workers as w
from harness import run_distributed


@pytest.mark.parametrize("strategy,spelling,keep_grads", [
    ("optim_grads_params", "verl", False), ("optim_grads_params", "verl", True), ("optim_grads", "verl", True),
    ("no_shard", "verl", True), ("optim_grads_params", "nemo_rl", False), ("optim_grads_params", "swap", True), ("optim_grads", "per_param", False)])
def test_park_on_host_and_resume_trains_like_one_process(strategy, spelling, keep_grads):
    results = run_distributed(w.park_and_resume, 2, strategy, spelling, keep_grads, timeout=180)
    assert all(r["worst"]["param"] <= 1e-5 for r in results), results


def test_device_moves_a_unit_cannot_take_are_refused():
    run_distributed(w.moves_refused, 2, timeout=120)


def test_park_with_an_offloaded_unit_after_a_forward_without_backward():
    run_distributed(w.park_edge_cases, 2, timeout=180)


def test_a_unit_of_several_modules_moves_only_with_all_of_them():
    run_distributed(w.group_unit_moves, 2, timeout=120)
