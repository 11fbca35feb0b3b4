"""Deferred (meta-device) init on Gloo: a model built on the meta device, sharded and
materialized holds exactly the values of the model built directly on the device with the
same seed, for worlds 1, 2 and 4, every strategy, tied weights and bf16 compute, and trains
like it (gradients and parameters); one module is full size at a time; misuse is refused."""
import pytest

from harness import run_distributed
from harness.init_workers import (apply_inside_a_unit_is_not_to_empty, deferred_init_errors, deferred_init_parity, init_one_module_at_a_time,
                                   load_state_dict_into_meta_model,
                                   load_into_meta_model, load_into_meta_model_errors, load_safetensors_into_meta_model,
                                   to_empty_inside_a_unit_then_load_the_rest, to_empty_then_reset_parameters)

CASES = {
    "world1": (1, {}),
    "zero3_w2": (2, {}),
    "zero2_w2": (2, {"strategy": "optim_grads"}),
    "zero1_w2": (2, {"strategy": "optim"}),
    "no_shard_w2": (2, {"strategy": "no_shard"}),
    "tied_w2": (2, {"tie": True}),
    "bf16_w2": (2, {"param_dtype": "bf16"}),
    "zero3_w4": (4, {}),
    "tied_zero2_w4": (4, {"tie": True, "strategy": "optim_grads"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_materialized_values_equal_a_direct_build_and_train_alike(case):
    import torch

    world, opts = CASES[case]
    if opts.get("param_dtype") == "bf16":
        opts = dict(opts, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = run_distributed(deferred_init_parity, world, opts, timeout=240)
    assert all(r["checked_elements"] > 0 for r in results)


def test_one_module_full_size_at_a_time():
    run_distributed(init_one_module_at_a_time, 2, timeout=180)


def test_deferred_init_misuse_is_refused():
    run_distributed(deferred_init_errors, 2, timeout=180)


LOADS = {
    "every_rank_w2": (2, {}),
    "broadcast_w2": (2, {"broadcast": True}),
    "broadcast_tied_zero2_w4": (4, {"broadcast": True, "tie": True, "strategy": "optim_grads"}),
    "broadcast_no_shard_w2": (2, {"broadcast": True, "strategy": "no_shard"}),
    "every_rank_w1": (1, {}),
}


@pytest.mark.parametrize("case", list(LOADS))
def test_full_state_dict_loads_into_a_model_built_on_meta(case):
    world, opts = LOADS[case]
    run_distributed(load_into_meta_model, world, opts, timeout=240)


def test_loading_into_meta_model_misuse_is_refused():
    run_distributed(load_into_meta_model_errors, 2, timeout=180)


SAFETENSORS = {
    "zero3_w2": (2, {}),
    "tied_w2_bf16_file": (2, {"tie": True, "file_dtype": "bf16"}),
    "zero2_w4": (4, {"strategy": "optim_grads"}),
}


@pytest.mark.parametrize("case", list(SAFETENSORS))
def test_safetensors_directory_loads_into_a_model_built_on_meta(case, tmp_path):
    import torch

    world, opts = SAFETENSORS[case]
    if opts.get("file_dtype") == "bf16":
        opts = dict(opts, file_dtype=torch.bfloat16)
    directory = tmp_path / "hf"
    directory.mkdir()
    run_distributed(load_safetensors_into_meta_model, world, opts, str(directory), timeout=240)


@pytest.mark.parametrize("world,strategy", [(2, "optim_grads_params"), (3, "optim_grads"), (2, "no_shard")])
def test_torch_loads_into_a_model_built_on_meta(world, strategy):
    run_distributed(load_state_dict_into_meta_model, world, {"strategy": strategy}, timeout=240)


@pytest.mark.parametrize("world", [2, 3])
def test_to_empty_then_initializers_give_one_process_values(world):
    assert run_distributed(to_empty_then_reset_parameters, world, timeout=180) == [True] * world


def test_to_empty_on_a_module_around_ours_gives_one_process_values():
    """nn.Module.to_empty on a plain module holding the sharded one (Lightning's Trainer
    calls it on its LightningModule) reaches our units through _apply: they are
    materialized and watched as by their own to_empty, not left waiting for values."""
    assert run_distributed(to_empty_then_reset_parameters, 2, "outer", timeout=180) == [True] * 2


@pytest.mark.parametrize("world,load", [(2, "assign_dtensors"), (3, "assign_dtensors"), (2, "full_values")])
def test_to_empty_inside_a_unit_then_loading_the_rest_gives_one_process_values(world, load):
    """torchtune's first LoRA run: to_empty() and initializers on the adapters inside a unit
    built on meta, then the base weights loaded alone. Once, the emptied adapters stayed
    waiting for values and the unit never counted as loaded (a forward refused it)."""
    assert run_distributed(to_empty_inside_a_unit_then_load_the_rest, world, load, timeout=180) == [True] * world


def test_other_functions_applied_inside_a_unit_keep_their_meaning_on_every_rank():
    """A whole value applied to a 1-D bias that one rank holds whole and the other none of
    was once taken for to_empty on the first rank only (decided by piece shape)."""
    assert run_distributed(apply_inside_a_unit_is_not_to_empty, 2, timeout=180) == [True] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_initializers_after_fully_shard_give_one_process_values(world):
    """model.apply(init_fn) on a model built whole and sharded: whole-parameter draws too,
    where each rank once drew its piece from the same stream (repeated values across ranks,
    RNG out of step)."""
    assert run_distributed(to_empty_then_reset_parameters, world, "built", timeout=180) == [True] * world
