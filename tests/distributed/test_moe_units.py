"""Mixture-of-experts units (issue 44, item 1) on Gloo at worlds 4 and 8: a block whose dense
parameters shard over the data-parallel mesh and whose experts (expert-parallel DTensors)
shard over the expert data-parallel mesh, from FSDP2's ShardPlacementResult as torchtitan
0.3.0 passes it. The same script under torch's fully_shard is the reference: losses,
global gradient norms, every step's full gradients (SGD), the parameters after, and the
state-dict placements must match; checkpoints move between the two systems."""
import pytest

from harness import run_distributed
from harness import moe_unit_workers as w


@pytest.mark.parametrize("world, ep, replicate, factor", [
    (4, 2, 1, 1.0),  # torchtitan's: gradient division off on every unit
    (4, 2, 1, None),  # FSDP2's default: each mesh divides by its own size
    (4, 4, 1, 1.0),  # efsdp of size 1: experts never gathered, only reduced over nothing
    (4, 2, 2, 1.0),  # HSDP: (dp_replicate, fsdp) dense, (dp_replicate, efsdp) experts
    (8, 2, 1, 1.0),  # efsdp 4 x ep 2
    (8, 4, 2, None),  # HSDP 2 x (efsdp 1 x ep 4)
], ids=["w4_ep2", "w4_ep2_default_division", "w4_ep4", "w4_hsdp2x2_ep2", "w8_ep2", "w8_hsdp2_ep4"])
def test_moe_units_train_like_fsdp2(world, ep, replicate, factor):
    worst = run_distributed(w.moe_vs_fsdp2, world, ep, replicate, factor, timeout=300)[0]
    assert set(worst) == {"loss", "norm", "grad", "param"}


def test_moe_checkpoints_move_between_fsdp2_and_ours(tmp_path):
    result = run_distributed(w.moe_checkpoints_move_between_systems, 4, 2, str(tmp_path), timeout=240)[0]
    assert result == {"fsdp2_to_ours": 0.0, "ours_to_fsdp2": 0.0, "native": 0.0}


def test_moe_placement_refusals():
    run_distributed(w.moe_placement_refusals, 2, timeout=120)


def test_moe_checkpoints_move_across_expert_parallel_degrees(tmp_path):
    result = run_distributed(w.moe_checkpoints_move_across_expert_parallelism, 4, str(tmp_path), timeout=240)[0]
    assert result == {"ep2_to_ep4": 0.0, "ep2_to_ep0": 0.0, "no_ep_to_ep2": 0.0}


def test_megatron_style_expert_mesh_trains_like_fsdp2():
    """FSDPConfig / fully_shard_model(expt_device_mesh=...) with Megatron-Core's allreduce=False
    expert marking: the placement and gradient scaling Megatron-FSDP uses, against FSDP2."""
    worst = run_distributed(w.moe_megatron_config_vs_fsdp2, 4, 2, timeout=240)[0]
    assert set(worst) == {"loss", "grad"}


@pytest.mark.parametrize("world, ep, replicate, factor", [
    (4, 2, 1, 1.0), (4, 2, 2, None), (8, 4, 1, None)], ids=["w4_ep2", "w4_hsdp2x2_ep2_default_division", "w8_ep4"])
def test_moe_units_train_like_one_process(world, ep, replicate, factor):
    """The same training against one plain process holding every expert (no FSDP2 in it)."""
    worst = run_distributed(w.moe_vs_one_process, world, ep, replicate, factor, timeout=300)[0]
    assert set(worst) == {"loss", "norm", "grad", "param"}


@pytest.mark.parametrize("world, ep, form", [(2, 2, "placement"), (4, 2, "placement"), (4, 2, "nested"),
                                             (4, 4, "placement")])
def test_library_moe_model_with_expert_parallelism_trains_like_one_process(world, ep, form):
    """megatron_fsdp_ext.models.MoEModel (the benchmarks' MoE: routing, capacity, the
    all-to-all token exchange) with expert parallelism under our units, both ways of
    putting experts on their mesh, against one process running every rank's batch."""
    worst = run_distributed(w.moe_model_expert_parallel_vs_one_process, world, ep, form, timeout=300)[0]
    assert set(worst) == {"loss", "grad", "param"}
