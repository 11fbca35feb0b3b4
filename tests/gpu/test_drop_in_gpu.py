"""The drop-in tests with CUDA tensors on the GPU suite's backend: torch's clip_grad_norm_
over our ShardedGrad gradients equals FSDP2's (FSDP at every world; HSDP and FSDP x TP at
world 4 and above); between backward and the step our parameters and gradients are
FSDP2's DTensors (meshes, placements, full values, torchtitan's clip); Megatron's
no_sync + finish_grad_sync over a 1F1B order equals one plain process."""
import pytest

from harness import drop_in_workers as w
from harness import gpu_launch, gpu_world, run_distributed

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


TWO_D = pytest.mark.gpu_world(4, 6, 8)  # a 2-D mesh needs an even world of at least 4


@pytest.mark.parametrize("layout,norm_type", [("fsdp", 2.0), ("fsdp", float("inf")),
                                              pytest.param("hsdp", 2.0, marks=TWO_D),
                                              pytest.param("tp", 2.0, marks=TWO_D)])
@pytest.mark.dtensor_collectives
def test_torch_clip_grad_norm_equals_fsdp2_gpu(layout, norm_type):
    results = run_distributed(w.norms_equal_fsdp2, WORLD, layout, norm_type, "optim_grads_params", **GPU,
                              timeout=240)
    assert all(r == results[0] for r in results), results


@pytest.mark.parametrize("layout,strategy", [("fsdp", "optim_grads_params"), ("fsdp", "no_shard"),
                                             pytest.param("hsdp", "optim_grads", marks=TWO_D),
                                             pytest.param("tp", "optim_grads_params", marks=TWO_D)])
@pytest.mark.dtensor_collectives
def test_parameters_and_gradients_are_fsdp2s_dtensors_gpu(layout, strategy):
    try:
        import torchtitan  # noqa: F401
        titan = True
    except ImportError:  # not installed on the GPU machines: torchtitan's clip runs in CI (tests/distributed)
        titan = False
    results = run_distributed(w.dtensor_face, WORLD, layout, strategy, titan, **GPU, timeout=240)
    assert all(r == results[0] for r in results), results


def test_megatron_no_sync_and_finish_grad_sync_gpu():
    assert run_distributed(w.megatron_1f1b, WORLD, "optim_grads_params", **GPU, timeout=240) == [True] * WORLD


def test_every_norm_order_nan_and_norms_after_the_step_gpu():
    """Every norm order (-inf and 0 included), a NaN on a later rank (NCCL's MAX) and norms
    after the step, against plain PyTorch with CUDA tensors."""
    assert run_distributed(w.norm_orders, WORLD, **GPU, timeout=240) == [True] * WORLD


@pytest.mark.dtensor_collectives
def test_code_that_decides_by_shape_sees_the_parameters_shape_gpu():
    """nanoGPT's and Megatron's weight-decay rules against plain PyTorch, nn.init's fan-in,
    the refusal of a gradient-shaped tensor meeting the piece: with CUDA tensors."""
    assert run_distributed(w.shape_choices, WORLD, **GPU, timeout=240) == [True] * WORLD


@pytest.mark.gpu_world(2)  # the layout it checks: each vector whole on one rank of two
def test_casts_and_other_parameters_pieces_as_operands_gpu():
    assert run_distributed(w.casts_and_piece_operands, WORLD, **GPU, timeout=240) == [True] * WORLD


def test_ema_across_layouts_and_parameter_vectors_gpu():
    """An EMA sharded otherwise than the trained model (in-place ops between layouts),
    parameters_to_vector of parameters and gradients, vector_to_parameters refused: on
    device tensors, against one plain process on the same device."""
    for worst in run_distributed(w.ema_and_vectors_across_layouts, WORLD, **GPU, timeout=240):
        assert len(worst) == 9 and all(v < 1e-5 for v in worst.values()), worst


def test_prune_and_parametrize_on_a_unit_are_refused_gpu():
    assert run_distributed(w.prune_and_parametrize_refused, WORLD, **GPU, timeout=240) == [True] * WORLD


def test_compiled_optimizer_step_with_inductor_gpu():
    """torch.compile (inductor, CUDA) of AdamW's step over sharded parameters trains as
    plain PyTorch and does not recompile every step."""
    assert run_distributed(w.compiled_optimizer_step, WORLD, "inductor", **GPU, timeout=480) == [True] * WORLD


@pytest.mark.parametrize("case", ["bf16_model_upcast", "fp32_model_half"])
@pytest.mark.dtensor_collectives
def test_dtype_change_after_fully_shard_trains_like_fsdp2_gpu(case):
    from harness import convert_workers

    run_distributed(convert_workers.dtype_change_after_fully_shard, WORLD, case, **GPU, timeout=240)


@pytest.mark.dtensor_collectives
def test_meta_state_dict_and_assign_load_like_fsdp2_gpu():
    from harness import convert_workers

    run_distributed(convert_workers.meta_state_dict_and_assign, WORLD, **GPU, timeout=240)
    run_distributed(convert_workers.dtype_changes_refused, WORLD, **GPU, timeout=240)


def test_reference_model_sync_across_unit_layouts_gpu():
    assert run_distributed(w.reference_model_sync, WORLD, **GPU, timeout=240) == [True] * WORLD
