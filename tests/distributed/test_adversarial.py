"""What an adversarial user found (each test failed before its fix): freezing after
fully_shard, per-rank paths and option differences, bad values in a full state dict,
unclear errors."""
import pytest

from harness import run_distributed
from harness import adversarial_workers as AW


@pytest.mark.parametrize("opts", [{}, {"gather_bucket_bytes": 1 << 30, "reduce_bucket_bytes": 1 << 30}],
                         ids=["per_unit", "buckets"])
def test_freezing_after_fully_shard_works_like_plain_pytorch(opts):
    run_distributed(AW.freeze_after_sharding, 2, opts, timeout=180)


def test_load_safetensors_refuses_per_rank_paths_and_names_a_truncated_file(tmp_path):
    run_distributed(AW.safetensors_misuse, 2, str(tmp_path), timeout=180)


@pytest.mark.parametrize("broadcast", [False, True])
def test_load_full_state_dict_refuses_bad_values_on_every_rank_before_writing(broadcast):
    run_distributed(AW.full_state_dict_bad_values, 2, broadcast, timeout=120)


def test_load_full_state_dict_refuses_models_whose_hooks_reshape_parameters():
    run_distributed(AW.full_state_dict_with_reshaping_hooks, 2, timeout=120)


@pytest.mark.parametrize("kind", ["gather_bucket_bytes", "reduce_bucket_bytes"])
def test_ranks_that_bucket_differently_are_refused_at_the_first_forward(kind):
    run_distributed(AW.bucket_options_differ, 2, kind, timeout=120)


def test_bucket_setters_differing_after_the_first_step_are_named_by_the_collective_check():
    run_distributed(AW.bucket_setters_differ_under_check, 2, timeout=180)


def test_unclear_inputs_now_work_or_name_the_problem():
    run_distributed(AW.unclear_inputs, 1, timeout=120)
    run_distributed(AW.unclear_inputs, 2, timeout=120)


def test_fully_shard_model_names_mesh_dims_in_the_wrong_order():
    run_distributed(AW.mesh_dims_in_the_wrong_order, 4, timeout=120)


@pytest.mark.parametrize("opts", [{}, {"gather_bucket_bytes": 1 << 30, "reduce_bucket_bytes": 1 << 30},
                                  {"strategy": "optim"}], ids=["per_unit", "buckets", "zero1"])
def test_check_for_nan_in_grad_refuses_the_step_on_every_rank(opts):
    run_distributed(AW.nan_check, 2, opts, timeout=180)


def test_check_for_nan_in_grad_changes_nothing_when_gradients_are_finite():
    from harness.workers import check_parity_results, train_parity

    results = run_distributed(train_parity, 2, {"check_for_nan_in_grad": True, "steps": 3, "clip": 0.05},
                              timeout=180)
    check_parity_results(results, steps=3)
