"""Tensor parallel x fully_shard with CUDA tensors: the Gloo suite's TP tests on the GPU
suite's backend (NCCL with a GPU per rank, or Gloo with every rank on one GPU, where TP's
own collectives go through plain c10d calls: harness/funcol_c10d.py). World 2 runs dp1 x tp2
and dp2 x tp1, world 4 dp2 x tp2, world 8 replicate2 x dp2 x tp2; FSDP2+TP, state dicts and
deferred init on (world/2) x 2."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import tp_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()
SHAPES = {2: [(1, 2), (2, 1)], 4: [(2, 2)], 8: [(2, 2, 2)]}.get(WORLD, [])
SCENARIOS = [{"sp": sp, "strategy": s, "clip": 0.05, "tol": 1e-4} for sp in (False, True)
             for s in ("optim_grads_params", "optim_grads", "optim", "no_shard")] + \
    [{"sp": True, "micro": 2, "buckets": 1 << 30, "tol": 1e-4},
     # CPU offload: the TP shards' pieces in (pinned) host memory, copied in for each gather
     {"sp": False, "offload": True, "clip": 0.05, "tol": 1e-4},
     {"sp": True, "offload": True, "strategy": "optim_grads", "micro": 2, "tol": 1e-4}]


@pytest.mark.parametrize("shape", SHAPES or [None], ids=lambda s: "x".join(map(str, s)) if s else "none")
def test_tp_trains_like_one_process_gpu(shape):
    if shape is None:
        pytest.skip(f"no TP mesh for world {WORLD}")
    run_distributed(w.tp_parity, WORLD, shape, SCENARIOS, **GPU, timeout=400)


HALF = (WORLD // 2, 2)


def _needs_even_world():
    if WORLD < 2 or WORLD % 2:
        pytest.skip(f"a dp x tp2 mesh needs an even world, not {WORLD}")


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_matches_fsdp2_tp_in_bf16_gpu(sp):
    _needs_even_world()
    run_distributed(w.tp_vs_fsdp2, WORLD, HALF, sp, **GPU, timeout=300)


@pytest.mark.long_gpu
@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload"])
def test_tp_state_dicts_match_fsdp2_and_reshard_gpu(tmp_path, offload):
    _needs_even_world()
    run_distributed(w.tp_state_dicts, WORLD, str(tmp_path), offload=offload, **GPU, timeout=400)


def test_tp_deferred_init_gpu():
    _needs_even_world()
    run_distributed(w.tp_deferred_init, WORLD, HALF, **GPU, timeout=300)


def test_tp_to_empty_then_init_in_place_gpu():
    """torchtitan's Trainer way in with TP on CUDA: to_empty and reset_parameters give the
    TP model's values alone (DTensor's offset-based draws), a whole value lands in place."""
    _needs_even_world()
    run_distributed(w.tp_to_empty_then_init, WORLD, HALF, **GPU, timeout=300)
