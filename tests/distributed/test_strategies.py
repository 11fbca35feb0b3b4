"""Sharding strategies (no_shard / optim / optim_grads / optim_grads_params) on Gloo:
parity with the single-process reference for every public API, and DCP checkpoints
that reshard across world sizes and strategies."""
import pytest
import torch

from harness import run_distributed
from harness import strategy_workers as SW
from harness.workers import check_parity_results, train_parity

STRATEGIES = SW.STRATEGIES
# Tied, unused and frozen params, gradient accumulation without sync, clipping.
EVERYTHING = {"tie": True, "unused": True, "frozen": True, "micro_batches": 2, "clip": 0.05, "steps": 4}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_parity(strategy, world):
    check_parity_results(run_distributed(train_parity, world, dict(EVERYTHING, strategy=strategy), timeout=240),
                         steps=4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_parity_bf16(strategy):
    # Against FSDP2 under the same policy; AdamW, then SGD (momentum) with clipping,
    # whose update scales with the gradient.
    opts = {"strategy": strategy, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
            "lr": 1e-3, "micro_batches": 2, "steps": 4, "extra_runs": [{"optimizer": "sgd", "clip": 0.05}]}
    check_parity_results(run_distributed(train_parity, 2, opts, timeout=240), steps=4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_parity_accumulating_across_synced_backwards(strategy):
    opts = {"strategy": strategy, "micro_batches": 2, "sync_every_micro": True, "steps": 4}
    check_parity_results(run_distributed(train_parity, 2, opts, timeout=240), steps=4)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kept_copies_follow_fused_steps_and_data_writes(strategy, recompute):
    run_distributed(SW.kept_copies_follow_every_write, 2, strategy, recompute, timeout=180)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_kept_copies_follow_an_optimizer_given_more_params(strategy):
    run_distributed(SW.kept_copies_follow_added_param_groups, 2, strategy, timeout=180)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_checkpoint_odd_params_and_shape_check(tmp_path, strategy):
    run_distributed(SW.checkpoint_odd_params, 2, str(tmp_path / "ckpt"), strategy, timeout=180)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_api_and_errors(strategy):
    run_distributed(SW.strategy_api, 2, strategy, timeout=180)


@pytest.mark.parametrize("load_world", [4, 1])
def test_checkpoint_reshards_across_world_sizes(tmp_path, load_world):
    path = str(tmp_path / "ckpt")
    run_distributed(SW.checkpoint_save, 2, "optim_grads_params", path, timeout=180)
    run_distributed(SW.checkpoint_resume, load_world, "optim_grads_params", path, timeout=180)


@pytest.mark.parametrize("save_strategy,load_strategy", [
    ("optim_grads_params", "no_shard"), ("no_shard", "optim_grads_params"),
    ("optim", "optim_grads"), ("optim_grads", "optim_grads_params"),
])
def test_checkpoint_across_strategies(tmp_path, save_strategy, load_strategy):
    path = str(tmp_path / "ckpt")
    run_distributed(SW.checkpoint_save, 2, save_strategy, path, timeout=180)
    run_distributed(SW.checkpoint_resume, 2, load_strategy, path, timeout=180)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_resume_is_bitwise_identical(tmp_path, strategy):
    run_distributed(SW.checkpoint_bitwise_resume, 2, strategy, str(tmp_path / "ckpt"), timeout=180)


def test_checkpoint_bad_input(tmp_path):
    run_distributed(SW.checkpoint_bad_input, 2, str(tmp_path / "ckpt"), timeout=180)


@pytest.mark.parametrize("config", [
    {},
    {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": False, "overlap_param_gather": False},
    {"data_parallel_sharding_strategy": "optim", "fsdp_all_gather_in_start_param_sync": False},
    {"data_parallel_sharding_strategy": "no_shard"},
])
def test_megatron_config_entry_point(config):
    results = run_distributed(SW.megatron_config_parity, 2, config, timeout=180)
    assert results[0]["units"] == 4  # three blocks and the root


def test_megatron_config_size_based_units():
    # No unit classes: modules are grouped bottom-up into units of >= bucket_size elements.
    results = run_distributed(SW.megatron_config_parity, 2, {"bucket_size": 10_000}, False, timeout=180)
    assert 2 <= results[0]["units"] <= 8


def test_megatron_config_errors():
    run_distributed(SW.megatron_config_errors, 1, timeout=120)
