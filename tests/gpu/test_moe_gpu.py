"""Mixture-of-experts units with CUDA tensors: the Gloo suite's MoE checks (tests/distributed/
test_moe_units.py) on the GPU suite's backend, so the two meshes of one unit (dense parameters
on the data-parallel mesh, experts on the expert data-parallel mesh) gather and reduce on the
unit's CUDA streams under NCCL. Against FSDP2 given the same placements: losses, global norms,
every step's full gradients (SGD) and the parameters after; checkpoints both ways.
World 2 runs ep 2 (the expert data-parallel mesh has one rank); world 4 adds ep 2 x efsdp 2
and HSDP; world 8 ep 4 x efsdp 2."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import moe_unit_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()
# (ep, replicate, gradient divide factor): 1.0 is torchtitan's, None FSDP2's default.
CASES = {2: [(2, 1, 1.0), (2, 1, None)],
         4: [(2, 1, 1.0), (2, 1, None), (4, 1, 1.0), (2, 2, 1.0)],
         8: [(2, 1, 1.0), (4, 1, None), (4, 2, 1.0)]}.get(WORLD, [])


@pytest.mark.parametrize("case", CASES or [None], ids=lambda c: f"ep{c[0]}_rep{c[1]}_div{c[2]}" if c else "none")
def test_moe_units_train_like_fsdp2_gpu(case):
    if case is None:
        pytest.skip(f"no expert-parallel mesh for world {WORLD}")
    ep, replicate, factor = case
    worst = run_distributed(w.moe_vs_fsdp2, WORLD, ep, replicate, factor, **GPU, timeout=300)[0]
    assert set(worst) == {"loss", "norm", "grad", "param"}


def test_moe_checkpoints_move_between_fsdp2_and_ours_gpu(tmp_path):
    if WORLD < 2 or WORLD % 2:
        pytest.skip(f"ep 2 needs an even world, not {WORLD}")
    result = run_distributed(w.moe_checkpoints_move_between_systems, WORLD, 2, str(tmp_path), **GPU,
                             timeout=300)[0]
    assert result == {"fsdp2_to_ours": 0.0, "ours_to_fsdp2": 0.0, "native": 0.0}


def test_megatron_style_expert_mesh_trains_like_fsdp2_gpu():
    if WORLD < 2 or WORLD % 2:
        pytest.skip(f"ep 2 needs an even world, not {WORLD}")
    worst = run_distributed(w.moe_megatron_config_vs_fsdp2, WORLD, 2, **GPU, timeout=300)[0]
    assert set(worst) == {"loss", "grad"}
