"""HSDP on NCCL: fully_shard on the (1, world) and (world, 1) meshes (and (2, world/2)
where there are 4 GPUs or more) trains like one plain process, with the all-reduce across
replicas deferred under gradient accumulation on the CUDA side streams; checkpoints move
between HSDP and FSDP layouts."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness.hsdp_workers import hsdp_checkpoints, hsdp_parity

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)
SCENARIOS = [{"strategy": s, "micro": 2, "defer": True, "clip": 0.05, "tol": 1e-4}
             for s in ("optim_grads_params", "optim_grads", "optim", "no_shard")]


@pytest.mark.parametrize("replicate", sorted({1, WORLD} | ({2} if WORLD >= 4 and WORLD % 2 == 0 else set())))
def test_nccl_hsdp_trains_like_one_process(replicate):
    if WORLD < 2:
        pytest.skip("HSDP needs two GPUs or more")
    run_distributed(hsdp_parity, WORLD, replicate, SCENARIOS, **GPU, timeout=300)


@pytest.mark.long_gpu
def test_nccl_hsdp_checkpoints_move_between_meshes(tmp_path):
    if WORLD < 2:
        pytest.skip("HSDP needs two GPUs or more")
    run_distributed(hsdp_checkpoints, WORLD, str(tmp_path), **GPU, timeout=300)
