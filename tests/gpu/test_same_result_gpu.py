"""The same-result tests with CUDA tensors on the GPU suite's backend: writes through
`p.data` after the step are seen on every strategy, under offload and the overlapped CPU
step (against FSDP2 with the same mixed precision), and units called on inputs that need
no gradient, tied embeddings in a unit of several modules, dataclass outputs and
non-contiguous parameters train like one plain process, and so do training scripts'
gradient idioms, PCGrad's flat gradient vectors and an EMA swap through `.data`, and reductions of gradients besides
their norm; a loss term over sharded parameters is refused where it would be of pieces."""
import pytest
import torch

from harness import gpu_launch, gpu_world, run_distributed
from harness import same_result_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.mark.parametrize("strategy,param_dtype,offload", [
    ("optim_grads", None, "none"),
    ("optim", torch.bfloat16, "none"),
    ("no_shard", torch.bfloat16, "none"),
    ("optim_grads_params", torch.bfloat16, "cpu_adamw_overlapped"),
], ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.dtensor_collectives
def test_writes_through_data_after_the_step_gpu(strategy, param_dtype, offload):
    worst = run_distributed(w.data_writes_after_step, WORLD, strategy, param_dtype, offload, **GPU, timeout=240)[0]
    # NCCL may reduce in another order than FSDP2's gather-free path: bf16 rounding only.
    assert max(worst.values()) < (1e-5 if param_dtype is None else 1e-2), worst


@pytest.mark.parametrize("case", ["shared_on_raw_input", "tied_embedding", "dataclass_output",
                                  pytest.param("functional_call_leaves_the_model",
                                               marks=pytest.mark.dtensor_collectives),
                                  "hook_reads_weight_after_fully_shard"])
def test_units_called_again_and_dataclass_outputs_gpu(case):
    args = (1 << 20,) if case == "tied_embedding" else ()
    worst = run_distributed(getattr(w, case), WORLD, *args, **GPU, timeout=240)[0]
    assert worst["grad"] < 1e-4 and worst["loss"] < 1e-4, worst


@pytest.mark.parametrize("layout", ["units", "no_shard"])
def test_flat_gradient_vectors_train_like_one_process_gpu(layout):
    """PCGrad through parameters_to_vector and a full-shape `p.grad` write-back, CUDA
    gradients; flat vectors of pieces refused where pieces are split."""
    worst = run_distributed(w.flat_gradient_vectors, WORLD, layout, **GPU, timeout=240)[0]
    assert worst < 1e-5, worst


def test_non_contiguous_parameters_train_like_one_process_gpu():
    """Channels-last convolution weights and a transposed Linear weight, sharded on the
    device: packed in logical order."""
    worst = run_distributed(w.non_contiguous_parameters, WORLD, **GPU, timeout=240)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("layout", ["units", "buckets", "root", "hsdp"])
def test_parameters_used_on_some_ranks_only_get_their_gradient_gpu(layout):
    """The agreement on which parameters got gradients (an all-reduce(max) on the reduce
    stream, waited for only by a rank that lacks some) on NCCL: every rank lands plain
    PyTorch's gradient for a parameter used on some ranks only."""
    if layout == "hsdp" and WORLD % 2:
        pytest.skip("HSDP over (2, world / 2) needs an even world")
    worst = run_distributed(w.partly_used_parameters, WORLD, layout, **GPU, timeout=240)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("layout,micro_batches", [("units", 1), ("buckets", 2), ("hsdp", 2)])
def test_unit_without_any_gradient_on_some_ranks_still_reduces_gpu(layout, micro_batches):
    """A rank with no gradient in a unit joins the agreement (and waits for it on the
    host) and reduces zeros on the reduce stream, where other ranks reduce theirs."""
    if layout == "hsdp" and WORLD % 2:
        pytest.skip("HSDP over (2, world / 2) needs an even world")
    worst = run_distributed(w.aux_unit_used_on_some_ranks, WORLD, layout, micro_batches, **GPU, timeout=240)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("layout", ["no_sync", "hsdp_deferred"])
def test_module_zero_grad_drops_a_discarded_micro_batch_gpu(layout):
    """The dropped accumulation and partial sum on CUDA: zero_grad waits for a deferred
    reduction still adding into the partial sum on the reduce stream."""
    if layout == "hsdp_deferred" and WORLD % 2:
        pytest.skip("HSDP over (2, world / 2) needs an even world")
    worst = run_distributed(w.zero_grad_drops_a_discarded_micro_batch, WORLD, layout, **GPU, timeout=240)[0]
    assert worst["grad"] < 1e-5, worst


@pytest.mark.dtensor_collectives
def test_gradient_idioms_and_ema_swap_through_data_gpu():
    """Gradients replaced out of place before the clip, MAE's total norm of detached
    gradients, `p.ndimension()` groups, and an EMA swap through `.data` (the shard moves
    to fresh storage), on CUDA tensors against one plain process."""
    assert all(err < 1e-5 for err in run_distributed(w.gradient_idioms, WORLD, **GPU, timeout=240))
    for strategy in ("optim_grads_params", "no_shard"):
        assert all(run_distributed(w.ema_swap_through_data, WORLD, strategy, **GPU, timeout=240))


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
@pytest.mark.dtensor_collectives
def test_a_freeze_between_forward_and_backward_holds_gpu(strategy):
    assert run_distributed(w.freeze_between_forward_and_backward, WORLD, strategy, **GPU, timeout=240) == [True] * WORLD


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
@pytest.mark.dtensor_collectives
def test_row_writes_land_in_the_rows_gpu(strategy):
    run_distributed(w.row_writes, WORLD, strategy, **GPU, timeout=240)


def test_gradient_statistics_are_global_gpu():
    """Sums, means, maxima, std, counts and NaN checks of gradients (a NaN in one rank's
    piece: NCCL's MAX with the NaN flag) on device tensors, against one plain process."""
    worst = run_distributed(w.gradient_statistics, WORLD, "units", **GPU, timeout=240)
    assert all(r == worst[0] for r in worst), worst
    assert len(worst[0]) == 21 and max(worst[0].values()) < 1e-5, worst[0]


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_gradient_hooks_on_parameters_run_as_on_each_ddp_rank_gpu(strategy):
    assert all(run_distributed(w.gradient_hooks, WORLD, strategy, **GPU, timeout=240))


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_loss_term_over_sharded_parameters_is_refused_or_is_the_parameters_gpu(strategy):
    """A penalty over model.parameters() on CUDA pieces: refused in the backward on every
    rank under sharding, the parameter's under no_shard; taken while the units hold their
    gathered parameters it trains as one process."""
    results = run_distributed(w.penalty_over_parameters, WORLD, strategy, **GPU, timeout=240)
    # A group of one holds whole parameters, as no_shard does: nothing to refuse there.
    w.check_penalty_outcome(results, refused_expected=strategy != "no_shard" and WORLD > 1)
