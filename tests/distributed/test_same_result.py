"""Same script, same result: scripts FSDP2 and one plain process train alike, where our
units once gave silently different gradients or crashed (issue 41's probe), each compared
step by step with one plain process on the whole batch (gradients of every parameter)."""
import pytest
import torch

from harness import run_distributed
from harness import same_result_workers as w


def test_unit_called_on_input_without_grad_then_again():
    """A shared Linear applied to the raw input and again to a hidden state: the first
    call's backward comes after the unit's reduction (its inputs needed no gradient, so no
    post-backward marker): gathered again and reduced again, not a step late."""
    worst = run_distributed(w.shared_on_raw_input, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("world", [2, 3])
def test_non_contiguous_parameters_train_like_one_process(world):
    """Channels-last convolution weights and a transposed Linear weight (FSDP2 refuses
    them): packed in logical order, so values and gradients are one process's."""
    worst = run_distributed(w.non_contiguous_parameters, world, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("buckets", [0, 1 << 20], ids=["per_unit", "reduce_buckets"])
def test_tied_embedding_in_a_unit_of_several_modules(buckets):
    """fully_shard([embed, norm, head]) with the head tied to the embedding: the lookup's
    gradient (token ids need none) is reduced in the same step."""
    worst = run_distributed(w.tied_embedding, 2, buckets, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


def test_functional_call_computes_with_the_given_tensors_and_leaves_the_model():
    """torch.func.functional_call on a sharded model: the given tensors (all, or one) are
    used and get their gradients; the model keeps its values and gets no gradient."""
    worst = run_distributed(w.functional_call_leaves_the_model, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


def test_forward_hook_registered_after_fully_shard_reads_the_whole_weight():
    worst = run_distributed(w.hook_reads_weight_after_fully_shard, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


def test_unit_returning_a_dataclass():
    """A unit whose forward returns a plain @dataclass: its outputs get the pre-backward
    hook (the unit is gathered for backward), as FSDP2 finds them."""
    worst = run_distributed(w.dataclass_output, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("strategy,param_dtype,offload", [
    ("optim_grads_params", None, "none"),
    ("optim_grads", None, "none"),
    ("optim", None, "none"),
    ("no_shard", None, "none"),
    ("optim_grads_params", torch.bfloat16, "none"),
    ("optim_grads", torch.bfloat16, "none"),
    ("optim", torch.bfloat16, "none"),
    ("no_shard", torch.bfloat16, "none"),
    ("optim_grads_params", torch.bfloat16, "torch_sgd"),
    ("optim_grads_params", torch.bfloat16, "cpu_adamw"),
    ("optim_grads_params", torch.bfloat16, "cpu_adamw_overlapped"),
    ("optim_grads_params", None, "cpu_adamw"),
], ids=lambda v: str(v).replace("torch.", ""))
def test_writes_through_data_after_the_step_are_seen_like_fsdp2(strategy, param_dtype, offload):
    """A clamp, a manual EMA and a reset through `p.data` after each step (no version
    counter moves): the next forward must use the written values on every strategy (the
    kept gathered or cast copies), under offload (the bf16 host copy the CPU optimizer
    wrote) and with the overlapped CPU step, as FSDP2 (same mixed precision) does."""
    worst = run_distributed(w.data_writes_after_step, 2, strategy, param_dtype, offload, timeout=120)[0]
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("layout,world", [("units", 2), ("buckets", 2), ("root", 2), ("units", 3), ("hsdp", 4)])
def test_parameters_used_on_some_ranks_only_get_their_gradient(layout, world):
    """A parameter used on some ranks only (rank-dependent control flow) has plain
    PyTorch's gradient on every rank: the rank holding its piece landed nothing when it
    had not used it, and the parameter did not train there (FSDP2 hangs or fails here)."""
    worst = run_distributed(w.partly_used_parameters, world, layout, timeout=180)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("layout,world,micro_batches", [
    ("units", 2, 1), ("buckets", 2, 1), ("hsdp", 4, 1), ("units", 3, 2), ("buckets", 2, 2), ("hsdp", 4, 2)])
def test_unit_without_any_gradient_on_some_ranks_still_reduces(layout, world, micro_batches):
    """The root's only parameters are used on some ranks only: a rank with no gradient in
    the unit joins the reduction the others run (it once returned early and every rank
    hung), a step where no rank used them leaves them without a gradient, and accumulation
    with sync off carries the first micro-batch's use to the synced reduction."""
    worst = run_distributed(w.aux_unit_used_on_some_ranks, world, layout, micro_batches, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("layout,world", [("no_sync", 2), ("no_sync", 3), ("hsdp_deferred", 4)])
def test_module_zero_grad_drops_a_discarded_micro_batch(layout, world):
    """model.zero_grad() between micro-batches drops what the units accumulated unsynced
    (or hold in HSDP's deferred partial sum), as one plain process drops it from .grad."""
    worst = run_distributed(w.zero_grad_drops_a_discarded_micro_batch, world, layout, timeout=120)[0]
    assert worst["grad"] < 1e-5, worst


def test_gradient_idioms_of_training_scripts_give_one_process_results():
    assert all(err < 1e-5 for err in run_distributed(w.gradient_idioms, 2, timeout=180))


@pytest.mark.parametrize("layout,world", [("units", 2), ("units", 3), ("no_shard", 2)])
def test_flat_gradient_vectors_train_like_one_process(layout, world):
    """PCGrad through parameters_to_vector and `p.grad = vec[i:i + n].view(p.shape)` gives
    one process's gradients and weights; a flat vector of pieces is refused where pieces
    are split."""
    worst = run_distributed(w.flat_gradient_vectors, world, layout, timeout=120)[0]
    assert worst < 1e-5, worst

@pytest.mark.parametrize("layout,world", [("units", 2), ("units", 3), ("hsdp", 4)])
def test_gradient_statistics_are_global_like_one_process(layout, world):
    """Sums, means, maxima, std, counts and finiteness checks of gradient pieces are the
    whole gradient's on every rank (FSDP2's DTensors give these; pieces gave each rank's
    own, silently), and a NaN on one rank's piece skips the step on every rank."""
    worst = run_distributed(w.gradient_statistics, world, layout, timeout=180)
    assert all(r == worst[0] for r in worst), worst  # every rank saw the same values
    assert len(worst[0]) == 21 and max(worst[0].values()) < 1e-5, worst[0]


def test_optimizers_known_to_need_whole_parameters_are_refused_by_name():
    run_distributed(w.trust_ratio_optimizers_refused, 2, timeout=120)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_ema_swap_through_data_restores_the_training_weights(strategy):
    assert run_distributed(w.ema_swap_through_data, 2, strategy, timeout=120) == [True, True]


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_a_freeze_between_forward_and_backward_holds_like_one_process(strategy):
    assert run_distributed(w.freeze_between_forward_and_backward, 2, strategy, timeout=120) == [True, True]


@pytest.mark.parametrize("strategy,world", [("optim_grads_params", 2), ("optim_grads_params", 3), ("optim", 2),
                                            ("no_shard", 2)])
def test_row_writes_to_parameters_and_gradients_land_in_the_rows(strategy, world):
    run_distributed(w.row_writes, world, strategy, timeout=180)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_gradient_hooks_on_parameters_run_as_on_each_ddp_rank(strategy):
    assert run_distributed(w.gradient_hooks, 2, strategy, timeout=120) == [True, True]


def test_hugging_face_init_weights_after_fully_shard_zeroes_the_padding_row():
    pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")
    run_distributed(w.hf_init_weights_after_fully_shard, 2, timeout=180)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_loss_term_over_sharded_parameters_is_refused_or_is_the_parameters(strategy):
    """A norm penalty over model.parameters() where the module holds its sharded
    parameters is of each rank's piece (the probe's silent wrong: loss and gradients
    off): every rank refuses it in the backward, naming the parameter, also one frozen at
    fully_shard; under no_shard the piece is the parameter and it trains as one process.
    Taken while the units hold their gathered parameters it trains as one process."""
    results = run_distributed(w.penalty_over_parameters, 2, strategy, timeout=120)
    w.check_penalty_outcome(results, refused_expected=strategy != "no_shard")
