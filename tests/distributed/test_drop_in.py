"""Our modules are FSDP2's to torch's own code: instances of torch's FSDPModule with every
one of its methods answered, `fully_shard.state(m)` a view pipelining can drive, and
gradients whose norm torch's clip_grad_norm_ / get_total_norm compute globally across
ranks, equal to FSDP2's on FSDP, HSDP and FSDP x TP meshes; Megatron's no_sync and
finish_grad_sync over a 1F1B order."""
import pytest
import torch.distributed.fsdp as torch_fsdp

import megatron_fsdp_ext as mfsdp
from harness import drop_in_workers as w
from harness import run_distributed


def test_every_method_of_torchs_fsdpmodule_is_ours():
    """A method left to torch's FSDPModule would reach into FSDP2's private state (and
    crash or do nothing): each must be defined by our class."""
    torch_methods = {name for name, value in vars(torch_fsdp.FSDPModule).items()
                     if callable(value) or isinstance(value, property)} - {"__dict__", "__weakref__", "__doc__"}
    ours = set(vars(mfsdp.FSDPModule))
    missing = sorted(n for n in torch_methods if n not in ours)
    assert not missing, f"torch's FSDPModule methods our FSDPModule does not override: {missing}"
    assert issubclass(mfsdp.FSDPModule, torch_fsdp.FSDPModule)
    assert issubclass(mfsdp.UnshardHandle, torch_fsdp.UnshardHandle)


def test_modules_are_torchs_fsdpmodules():
    assert run_distributed(w.identity, 2, timeout=120) == [True, True]


def test_reset_iter_state_after_a_failed_backward():
    assert run_distributed(w.reset_iter_state, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("layout,world,norm_type,strategy", [
    ("fsdp", 2, 2.0, "optim_grads_params"),
    ("fsdp", 4, float("inf"), "optim_grads_params"),
    ("fsdp", 2, 1.0, "optim_grads"),
    ("hsdp", 4, 2.0, "optim_grads_params"),
    ("tp", 4, 2.0, "optim_grads_params"),
])
def test_torch_clip_grad_norm_is_global_and_equals_fsdp2(layout, world, norm_type, strategy):
    results = run_distributed(w.norms_equal_fsdp2, world, layout, norm_type, strategy, timeout=180)
    assert all(r == results[0] for r in results), results  # every rank the same global norm
    assert results[0][0] > 0.05, "clipping must be active for the test to mean something"


@pytest.mark.parametrize("layout,world,strategy", [
    ("fsdp", 2, "optim_grads_params"),
    ("fsdp", 2, "no_shard"),
    ("hsdp", 4, "optim_grads"),
    ("tp", 4, "optim_grads_params"),
])
def test_parameters_and_gradients_are_fsdp2s_dtensors_between_backward_and_step(layout, world, strategy):
    results = run_distributed(w.dtensor_face, world, layout, strategy, timeout=240)
    assert all(r == results[0] for r in results), results
    assert results[0][0] > 0


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim", "no_shard"])
def test_megatron_no_sync_and_finish_grad_sync_over_1f1b(strategy):
    assert run_distributed(w.megatron_1f1b, 2, strategy, timeout=180) == [True, True]


def test_gradient_norms_as_fsdp2_users_write_them():
    assert run_distributed(w.norm_patterns, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("world", [2, 4])
def test_every_norm_order_nan_and_norms_after_the_step_match_plain_pytorch(world):
    assert run_distributed(w.norm_orders, world, timeout=180) == [True] * world


def test_norms_of_long_gradient_pieces_are_accurate():
    """A unit's flat piece (here 1.6M elements a rank; CPU-offloaded units hold far longer
    ones) is longer than torch's CPU norm kernel sums accurately."""
    assert run_distributed(w.long_piece_norms, 2, timeout=180) == [True, True]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_code_that_decides_by_shape_sees_the_parameters_shape(world):
    assert run_distributed(w.shape_choices, world, timeout=180) == [True] * world


def test_casts_and_other_parameters_pieces_as_operands():
    assert run_distributed(w.casts_and_piece_operands, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("world", [2, 3])
def test_reference_model_sync_across_unit_layouts(world):
    assert run_distributed(w.reference_model_sync, world, timeout=120) == [True] * world


@pytest.mark.parametrize("world", [2, 3])
def test_ema_across_layouts_and_parameter_vectors_match_one_process(world):
    """EMA code updating a copy sharded as one unit from a model sharded per layer
    (`e.lerp_(p, w)`, `e.mul_(d).add_(p, alpha=)`, `e.data.lerp_(p.data, w)`,
    `e.copy_(e * d + p * w)`, `e -= w * (e - p)`): before, the pieces met elementwise
    (a shape error, or silently wrong where lengths agreed). torch's parameters_to_vector
    of parameters and gradients gave this rank's fragment (a local norm, silently);
    vector_to_parameters is refused by name on every rank and the full-value spelling it
    names writes the vector back."""
    worst = run_distributed(w.ema_and_vectors_across_layouts, world, timeout=180)[0]
    assert set(worst) == {"grad_vector", "grad_vector_norm", "param_vector", "vector_to_parameters", "ema_lerp_",
                          "ema_mul_add_", "ema_data_lerp_", "ema_copy_of_operators", "ema_isub_"}, worst
    assert max(worst.values()) < 1e-6, worst


def test_prune_and_parametrize_on_a_unit_are_refused_by_name():
    assert run_distributed(w.prune_and_parametrize_refused, 2, timeout=120) == [True, True]
