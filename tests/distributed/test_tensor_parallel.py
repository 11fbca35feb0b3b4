"""Tensor parallel x fully_shard on Gloo: torch's parallelize_module (Colwise/Rowwise/
SequenceParallel) on the "tp" dim, our fully_shard on the data-parallel dims of the same
mesh. World 4 as dp2 x tp2 and world 8 as replicate2 x dp2 x tp2 train like one plain
process (fp32: losses, gradients and clipped norms every step, parameters after) and like
FSDP2+TP (bf16); state dicts equal FSDP2+TP's (placements and values) and DCP checkpoints
move between them and across meshes; deferred init, full-state loads and misuse."""
import pytest

from harness import run_distributed
from harness import tp_workers as w

EVERY_STRATEGY = ["optim_grads_params", "optim_grads", "optim", "no_shard"]

SCENARIOS = {
    (2, 2): [{"sp": sp, "strategy": s, "clip": 0.05} for sp in (False, True) for s in EVERY_STRATEGY]
    + [{"sp": True, "micro": 2, "buckets": 1 << 30}, {"sp": False, "micro": 2, "prefetch": 0},
       {"sp": True, "strategy": "optim", "micro": 2, "buckets": 1 << 30},
       {"sp": True, "config": True, "clip": 0.05},
       # Activation checkpointing (torch's checkpoint_wrapper, torchtitan's): forward again in backward.
       {"sp": True, "ac": True, "clip": 0.05}, {"sp": False, "ac": True, "strategy": "optim_grads"},
       # CPU offload (CPUOffloadPolicy): the TP shards' flat pieces live in host memory.
       {"sp": False, "offload": True, "clip": 0.05}, {"sp": True, "offload": True, "strategy": "optim_grads", "micro": 2}],
    (2, 2, 2): [{"sp": True, "clip": 0.05}, {"sp": False, "strategy": "optim_grads", "micro": 2, "clip": 0.05},
                {"sp": True, "strategy": "no_shard", "clip": 0.05}, {"sp": False, "buckets": 1 << 30},
                {"sp": True, "config": True, "strategy": "optim_grads"}, {"sp": True, "ac": True},
                {"sp": True, "offload": True, "clip": 0.05}],
}


@pytest.mark.parametrize("shape", list(SCENARIOS), ids=lambda s: "x".join(map(str, s)))
def test_tp_trains_like_one_process(shape):
    world = 1
    for s in shape:
        world *= s
    results = run_distributed(w.tp_parity, world, shape, SCENARIOS[shape], timeout=600)
    assert len(results[0]) == len(SCENARIOS[shape])


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_tp_matches_fsdp2_tp_in_bf16(sp):
    run_distributed(w.tp_vs_fsdp2, 4, (2, 2), sp, timeout=300)


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "cpu_offload"])
def test_tp_state_dicts_match_fsdp2_and_reshard(tmp_path, offload):
    report = run_distributed(w.tp_state_dicts, 4, str(tmp_path), offload=offload, timeout=600)[0]
    assert report["strided"] > 0 and report["model_entries"] > 0 and report["optim_entries"] > 0


def test_tp_deferred_init():
    run_distributed(w.tp_deferred_init, 4, (2, 2), timeout=300)


def test_tp_to_empty_then_init_in_place():
    """torchtitan's Trainer builds on meta, then to_empty and init_weights: with TP units
    that was refused at the first forward ("hold no parameter values yet")."""
    run_distributed(w.tp_to_empty_then_init, 4, (2, 2), timeout=300)


def test_tp_full_state_dict_and_safetensors(tmp_path):
    run_distributed(w.tp_full_state_dict_roundtrip, 4, str(tmp_path), timeout=300)


def test_tp_misuse_is_refused():
    run_distributed(w.tp_misuse, 4, timeout=300)


def test_tp_on_unnamed_meshes_is_refused_naming_the_problem():
    run_distributed(w.tp_unnamed_meshes, 4, timeout=300)


@pytest.mark.parametrize("sp,tie", [(False, False), (True, True)], ids=["no_sp-untied", "sp-tied"])
def test_llama_tensor_parallel_plan_trains_like_one_process(sp, tie):
    """The library's LlamaModel under models.tensor_parallel: fused projections laid out so
    that TP's row chunks hold whole heads and units; a tied embedding stays tied."""
    run_distributed(w.llama_tp_parity, 4, (2, 2), sp, tie, timeout=300)


def test_tp_hsdp_state_dicts_match_fsdp2(tmp_path):
    report = run_distributed(w.tp_hsdp_state_dicts, 8, str(tmp_path), timeout=600)[0]
    assert report["model_entries"] > 0 and report["optim_entries"] > 0


def test_tp_no_shard_data_replacement_refused():
    run_distributed(w.tp_no_shard_data_replacement_refused, 2, timeout=180)
