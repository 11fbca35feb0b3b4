"""Mixture-of-experts units with CUDA tensors: the Gloo suite's MoE checks (tests/distributed/
test_moe_units.py) on the GPU suite's backend, so the two meshes of one unit (dense parameters
on the data-parallel mesh, experts on the expert data-parallel mesh) gather and reduce on the
unit's CUDA streams under NCCL. Against one plain process holding every expert: losses,
global norms, every step's full gradients (SGD) and the parameters after; DCP checkpoints
across expert-parallel degrees and our own checkpoints. Against FSDP2 as well where torch has
ShardPlacementResult (2.12 and later; the GPU machine's 2.11 has not).
World 2 runs ep 2 (the expert data-parallel mesh has one rank); world 4 adds ep 2 x efsdp 2
and HSDP; world 8 ep 4 x efsdp 2."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import moe_unit_workers as w

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_world(2, 4, 8)]
WORLD = gpu_world()
GPU = gpu_launch()
# (ep, replicate, gradient divide factor): 1.0 is torchtitan's, None FSDP2's default.
CASES = {2: [(2, 1, 1.0), (2, 1, None)],
         4: [(2, 1, 1.0), (2, 1, None), (4, 1, 1.0), (2, 2, 1.0)],
         8: [(2, 1, 1.0), (4, 1, None), (4, 2, 1.0)]}.get(WORLD, [])


def _case_id(case):
    return f"ep{case[0]}_rep{case[1]}_div{case[2]}"


@pytest.mark.dtensor_collectives
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_moe_units_train_like_one_process_gpu(case):
    worst = run_distributed(w.moe_vs_one_process, WORLD, *case, **GPU, timeout=300)[0]
    assert set(worst) == {"loss", "norm", "grad", "param"}


@pytest.mark.dtensor_collectives
def test_moe_checkpoints_move_across_expert_parallel_degrees_gpu(tmp_path):
    result = run_distributed(w.moe_checkpoints_move_across_expert_parallelism, WORLD, str(tmp_path), **GPU,
                             timeout=300)[0]
    assert set(result) >= {"ep2_to_ep0", "no_ep_to_ep2"} and all(v == 0.0 for v in result.values()), result


@pytest.mark.dtensor_collectives
@pytest.mark.parametrize("form", ["placement", "nested"])
def test_library_moe_model_with_expert_parallelism_gpu(form):
    """models.MoEModel (routing, capacity, the all-to-all token exchange on NCCL) with
    expert parallelism 2 under our units, against one process running every rank's batch."""
    worst = run_distributed(w.moe_model_expert_parallel_vs_one_process, WORLD, 2, form, **GPU, timeout=300)[0]
    assert set(worst) == {"loss", "grad", "param"}


if w.HAS_FSDP2_PLACEMENTS:  # FSDP2 shards experts on their own mesh from torch 2.12
    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_moe_units_train_like_fsdp2_gpu(case):
        worst = run_distributed(w.moe_vs_fsdp2, WORLD, *case, **GPU, timeout=300)[0]
        assert set(worst) == {"loss", "norm", "grad", "param"}

    def test_moe_checkpoints_move_between_fsdp2_and_ours_gpu(tmp_path):
        result = run_distributed(w.moe_checkpoints_move_between_systems, WORLD, 2, str(tmp_path), **GPU,
                                 timeout=300)[0]
        assert result == {"fsdp2_to_ours": 0.0, "ours_to_fsdp2": 0.0, "native": 0.0}

    def test_megatron_style_expert_mesh_trains_like_fsdp2_gpu():
        worst = run_distributed(w.moe_megatron_config_vs_fsdp2, WORLD, 2, **GPU, timeout=300)[0]
        assert set(worst) == {"loss", "grad"}
