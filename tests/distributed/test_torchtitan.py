"""torchtitan 0.3.0's own code on our fully_shard (swapped in for torch's, the only change).

- apply_fsdp_to_decoder at Gloo world 2, and parallelize_llama with tensor parallel 2 x
  FSDP 2 at world 4, each training its Llama3 debugmodel like one plain process.
- Its training loop: Trainer.train_step unchanged (gradient accumulation, the loss summed
  over tokens and divided by the GLOBAL count of valid tokens, its clip_grad_norm_ with
  clipping active, its AdamW and LR-schedule containers) on the debugmodel job, FSDP2 and
  ours side by side on the same ranks, step by step: FSDP (dp_shard 4), HSDP (2 x 2) and
  FSDP x TP (2 x 2) at world 4 (dp_shard 4 x tp 2 at world 8 with MFSDP_TITAN_WORLD8=1).
- What makes ours a drop-in there: our modules are torch FSDPModules, so torchtitan's
  disable_fsdp_gradient_division reaches them, and torch's clip computes the global norm.
- Its pipeline-parallel path (pipeline_llm, 1F1B and Interleaved1F1B) x FSDP 2 at world 4
  through train_step, FSDP2 and ours side by side.
- The debugmodel job's own loss, ChunkedLossWrapper (lm_head called per chunk), against FSDP2.
- Checkpoint interchange through torchtitan's CheckpointManager: FSDP2's checkpoint resumed
  on ours and ours on FSDP2, continuing exactly as the run that saved it.
- The debugmodel's fused wqkv through the CheckpointManager: its state-dict hooks see
  full-shape DTensors under ours too.
.ci/run installs torchtitan without its heavy extras (no triton, no torchdata, datasets or
tensorboard: titan_workers stubs what torchtitan.trainer imports of them)."""
import os

import pytest

from harness import run_distributed
from harness import titan_workers as w

_MISSING = w.available()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchtitan does not import here: {_MISSING}")

# Steps of each training comparison: 4 for CI time on a 2-core machine (4 ranks, two models
# each; every step compares loss, max local loss, clipped grad norm and lr, and a wrong
# gradient shows from the first); MFSDP_TITAN_STEPS=20 for longer curves (then raise
# pytest's --timeout).
STEPS = int(os.environ.get("MFSDP_TITAN_STEPS", "4"))
TOL = 1e-5  # relative: loss, max local loss, grad norm at every step; parameters at the end
WORLD4 = {
    "fsdp": {"data_parallel_shard_degree": 4},
    "hsdp": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2},
    "fsdp_tp": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
}
# Clipping: the debugmodel's grad norms here are ~0.8-1.5; every step must clip.
TRAIN = dict(max_norm=0.25, loss="ce", ac=True, local_bs=2, accum=2, tol=TOL)


def test_torchtitan_apply_fsdp_to_decoder():
    worst = run_distributed(w.titan_apply_fsdp, 2, timeout=300)[0]
    assert worst["param"] <= 1e-4


def test_torchtitan_to_empty_and_init_weights_give_one_process_values():
    """Trainer.__init__'s meta build, to_empty and init_weights, on ours: one plain
    process's values, bit for bit, then its training."""
    results = run_distributed(w.titan_to_empty_init_weights, 2, timeout=240)
    assert results[0]["param"] <= 1e-4 and results[0]["loss"] <= 1e-5, results[0]


def test_torchtitan_parallelize_llama_with_tp():
    worst = run_distributed(w.titan_parallelize_llama, 4, 2, timeout=300)[0]
    assert worst["param"] <= 1e-4


def test_torchtitan_tp_from_meta_as_its_trainer_builds():
    """Built on meta, parallelize_llama with TP, to_empty and init_states: TP units were
    refused at the first forward ("hold no parameter values yet")."""
    worst = run_distributed(w.titan_tp_from_meta, 4, 2, timeout=300)[0]
    assert worst["param"] <= 1e-4


@pytest.fixture(scope="module")
def world4_training():
    """The three world-4 parallelisms in one launch (torchtitan imports once per rank)."""
    return run_distributed(w.titan_train_matrix, 4, WORLD4, steps=STEPS, timeout=120 + 40 * STEPS, **TRAIN)[0]


def _check_training(result):
    assert "error" not in result, result["error"]
    worst = result["worst"]
    for key in ("loss", "max_loss", "grad_norm", "param"):
        assert worst[key] <= TOL, f"{key}: ours vs FSDP2 rel {worst[key]:.2e}"
    curves = result["curves"]
    assert len(curves["ours"]) == len(curves["fsdp2"]) == STEPS
    assert all(r["grad_norm"] > TRAIN["max_norm"] for r in curves["fsdp2"]), "clipping was not active"
    assert result["units"] >= 8  # tok_embeddings, 6 blocks, [norm, lm_head]


@pytest.mark.parametrize("config", list(WORLD4))
def test_torchtitan_training_loop_matches_fsdp2(world4_training, config):
    """torchtitan's train_step on FSDP2 and on ours: the same loss, max local loss, grad
    norm (clipped every step) and lr at every step, the same parameters at the end."""
    _check_training(world4_training[config])


@pytest.mark.skipif(os.environ.get("MFSDP_TITAN_WORLD8") != "1",
                    reason="8 ranks on a small CPU machine: set MFSDP_TITAN_WORLD8=1")
def test_torchtitan_training_loop_matches_fsdp2_world8():
    out = run_distributed(w.titan_train_matrix, 8, {"fsdp4_tp2": {"data_parallel_shard_degree": 4,
                                                                 "tensor_parallel_degree": 2}},
                          steps=STEPS, timeout=200 + 50 * STEPS, **TRAIN)[0]
    _check_training(out["fsdp4_tp2"])


def test_torchtitan_reaches_our_units_and_clips_the_global_norm():
    """Fails if torchtitan's disable_fsdp_gradient_division stops reaching our modules
    (they must be torch FSDPModules) or torch's clip stops computing the global norm of
    our sharded gradients: divide factors 1.0, grad norm equal to FSDP2's (1e-5) and to one
    plain process' on the whole batch (1e-4: fp32 norms of differently shaped pieces on the
    CPU), far from the local norm, and the clipped gradients those of the plain process."""
    out = run_distributed(w.titan_guard, 2, timeout=240)[0]
    assert out["units"] >= 8
    assert out["worst"]["grad_norm"] <= 1e-5 and out["worst"]["plain_norm"] <= 1e-4
    assert out["worst"]["grad"] <= 1e-5
    assert abs(out["local_norm"] - out["norm"]) > 0.05 * out["norm"]


def test_torchtitan_checkpoint_interchange_with_fsdp2(tmp_path):
    """torchtitan's CheckpointManager (DCP): FSDP2 and ours each save at step 2; ours
    resumes from FSDP2's checkpoint and FSDP2 from ours, and each continues exactly as
    the run that saved it (FSDP x TP at world 4). The debugmodel with separate q and kv
    projections; its fused wqkv is the test below."""
    out = run_distributed(w.titan_checkpoint_interchange, 4, {"data_parallel_shard_degree": 2,
                                                              "tensor_parallel_degree": 2},
                          str(tmp_path), fuse_qkv=False, timeout=300)[0]
    assert all(v <= TOL for v in out["worst"].values()), out["worst"]


def test_torchtitan_checkpoint_of_fused_qkv(tmp_path):
    """The debugmodel as it is (fused wqkv) through torchtitan's CheckpointManager:
    FusedQKVLinear splits wqkv in its state-dict post-hook and merges it in its load
    pre-hook, so those hooks must see full-shape DTensors under ours as under FSDP2 (our
    values are put in by the module owning each parameter, first among its hooks)."""
    out = run_distributed(w.titan_checkpoint_interchange, 2, {"data_parallel_shard_degree": 2}, str(tmp_path),
                          save_at=1, then=1, timeout=240)[0]
    assert all(v <= TOL for v in out["worst"].values()), out["worst"]


def test_torchtitan_chunked_loss_matches_fsdp2():
    """The debugmodel job's own loss, ChunkedLossWrapper: after the model's forward (norm
    ran, lm_head skipped) it calls lm_head once per sequence chunk, each with its own
    backward, with sync off and the unit kept unsharded (set_requires_gradient_sync,
    set_reshard_after_backward, unshard/reshard on lm_head, a member of the [norm, lm_head]
    unit). With activation checkpointing, at world 2."""
    out = run_distributed(w.titan_train_vs_fsdp2, 2, {"data_parallel_shard_degree": 2}, steps=4, loss="chunked",
                          ac=True, max_norm=TRAIN["max_norm"], tol=TOL, timeout=240)[0]
    assert all(v <= TOL for v in out["worst"].values()), out["worst"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_torchtitan_pipeline_parallel_matches_fsdp2(schedule):
    """torchtitan's own PP path (Trainer.__init__'s: pipeline_llm with its default 1F1B
    schedule, 2 stages of the debugmodel, or Interleaved1F1B, 4 stages, 2 per rank; parallelize_llama per stage with the fully_shard
    swap) x FSDP 2 at world 4, through its train_step (pp_forward_backward_step, loss over
    the global token count, clip_grad_norm_ with pp_mesh, its optimizers), FSDP2 and ours:
    per-step loss, max local loss and grad norm (clipped every step; equal on every rank)
    within 1e-5, and every parameter at the end. torchtitan 0.3.0 calls
    pp_schedule.step(arg_mbs=..., target_mbs=...), which torch here lacks: the worker routes
    it to the schedule's _step_microbatches (titan_workers._microbatch_step_shim)."""
    out = run_distributed(w.titan_pp_vs_fsdp2, 4, pp=2, schedule=schedule, steps=3,
                          max_norm=TRAIN["max_norm"], tol=TOL, timeout=300)[0]
    assert out["schedule"] == f"Schedule{schedule}"
    for key in ("loss", "max_loss", "grad_norm", "param"):
        assert out["worst"][key] <= TOL, f"{key}: ours vs FSDP2 rel {out['worst'][key]:.2e}"
    assert all(r["grad_norm"] > TRAIN["max_norm"] for r in out["curves"]["fsdp2"]), "clipping was not active"
    assert len(out["curves"]["ours"]) == 3 and out["units"] >= 3
