"""torchtitan 0.3.0's own options that reach fully_shard, set through its own job config,
on FSDP2 and on ours (the fully_shard swap) side by side: its Trainer.train_step on the
Llama3 debugmodel job (gradient accumulation, its global-token loss normalization, its
clip_grad_norm_ with clipping active, AdamW and LR schedule), FSDP over 2 Gloo ranks.
Every step: the global loss, the max local loss and the global grad norm within 1e-5
relative (fp32); every parameter at the end. Each option also shows on our units (and on
FSDP2's the same way), so that none of these passes by the option not being applied:

- parallelism.fsdp_reshard_after_forward "never" (FSDP2's ZeRO-2: reshard_after_forward
  False on every unit) and "always" (True on every unit, [norm, lm_head] included): each
  unit's effective value equals FSDP2's, and after the last block's forward every block
  and the embedding are still gathered ("never") or already freed ("always"), as under
  FSDP2; all are sharded again after the step.
- data_parallel_replicate_degree 2 with data_parallel_shard_degree 1, torchtitan's pure
  data parallelism (no sharding: HSDP on a (2, 1) mesh): every unit of ours has shard
  groups of one rank and reduces over the 2 replicas, as every group of FSDP2 does.
- training.enable_cpu_offload (CPUOffloadPolicy() on every unit): every unit of ours is
  offloaded (host shard and host gradient). FSDP2 under torchtitan's CPUOffloadPolicy()
  cannot run on a CPU-only machine (its pin_memory() raises "Cannot access accelerator
  device when none is available"); its reference run offloads with pin_memory=False.
  On this machine host and device are the same memory: this checks the plumbing.
- torchtitan's Float8LinearConverter (emulate=True: no FP8 matmul on the CPU): the same
  31 torchao Float8Linear layers under both, weights gathered in fp32; the losses differ
  from the fp32 run's (the FP8 casts are in effect).
- FP8 all-gather: torchtitan 0.3.0 has no option for it (the converter has no such
  field, and its Float8Linear, built by __init__, never wraps weights for it even when
  the torchao config asks). Here torchao's enable_fsdp_float8_all_gather is set in the
  converted layers' config and the weights wrapped as torchao's convert_to_float8_training
  does (titan_workers._wrap_for_float8_all_gather): FSDP2 gathers them through torchao's
  extension, ours by its FP8 gather (every Float8Linear weight, 31), and every layer
  computes on a Float8TrainingTensor weight in both.
- compile.enable with components ["model", "loss"] (backend aot_eager, counting): each
  block compiled by apply_compile (block.compile(fullgraph=True), before fully_shard) and
  the loss; under ours every block's forward and every loss ran compiled code, as many
  calls as under FSDP2.

- explicit buckets, as a torchtitan user sets them (its config has none): on the root
  parallelize_llama returned, set_gather_bucket_bytes / set_reduce_bucket_bytes of twice
  a block's gathered bytes before the first step (FSDP2 unchanged): the root's
  bucket_budgets() report them, its schedule cut the forward order into buckets of two
  or more units (gathers and reductions), and every micro-batch's backward but the first
  (which records the order: once per unit) reduce-scatters once per reduce bucket.

All eight in one launch (torchtitan imports once per rank). Every other run here (and in
test_torchtitan.py) keeps fully_shard's default "auto" budgets, which the first
backward's link measurement resolves (each result's "buckets" says to what)."""
import pytest

from harness import run_distributed
from harness import titan_workers as w

_MISSING = w.available()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchtitan does not import here: {_MISSING}")

STEPS = 3
TOL = 1e-5  # relative, fp32: loss, max local loss, grad norm every step; parameters at the end
MAX_NORM = 0.25  # below every step's grad norm (~1.4): clipping active


def _torchao_missing() -> str:
    from harness.fp8_workers import torchao_missing

    return torchao_missing()


@pytest.fixture(scope="module")
def options():
    names = [n for n in w.TITAN_OPTIONS if not (n.startswith("float8") and _torchao_missing())]
    return run_distributed(w.titan_options_matrix, 2, names, steps=STEPS, max_norm=MAX_NORM, tol=TOL,
                           timeout=600)[0]


def _trained_like_fsdp2(result) -> dict:
    assert "error" not in result, result["error"]
    for key in ("loss", "max_loss", "grad_norm", "param"):
        assert result["worst"][key] <= TOL, f"{key}: ours vs FSDP2 rel {result['worst'][key]:.2e}"
    curves = result["curves"]
    assert len(curves["ours"]) == len(curves["fsdp2"]) == STEPS
    assert all(r["grad_norm"] > MAX_NORM for r in curves["fsdp2"]), "clipping was not active"
    assert result["units"] >= 8  # tok_embeddings, 6 blocks, [norm, lm_head]
    return result["reached"]


@pytest.mark.parametrize("policy", ["never", "always"])
def test_reshard_after_forward_policy_matches_fsdp2(options, policy):
    reached = _trained_like_fsdp2(options[f"reshard_{policy}"])
    assert set(reached["reshard_after_forward"].values()) == {policy == "always"}
    early = {n: g for n, g in reached["gathered_after_forward"].items() if n not in ("norm", "lm_head")}
    assert len(early) == 7 and set(early.values()) == {policy == "never"}, early


def test_replicate_only_matches_fsdp2(options):
    reached = _trained_like_fsdp2(options["replicate_only"])
    assert reached["shard_replicate_sizes"] == [(1, 2)] and reached["units"] == 8


def test_cpu_offload_matches_fsdp2(options):
    reached = _trained_like_fsdp2(options["cpu_offload"])
    assert len(reached["offloaded"]) >= 9 and reached["host_bytes"] > 0


@pytest.mark.skipif(bool(_torchao_missing()), reason="torchao's float8 training does not import here")
def test_float8_converter_matches_fsdp2(options):
    reached = _trained_like_fsdp2(options["float8"])
    assert reached["float8_linears"] == 31 and reached["fp8_gathered_weights"] == 0
    fp32, fp8 = options["cpu_offload"]["curves"]["ours"][0]["loss"], options["float8"]["curves"]["ours"][0]["loss"]
    assert abs(fp8 - fp32) > 1e-5 * abs(fp32), f"the FP8 run's first loss {fp8} is the fp32 run's {fp32}"


@pytest.mark.skipif(bool(_torchao_missing()), reason="torchao's float8 training does not import here")
def test_float8_all_gather_matches_fsdp2(options):
    reached = _trained_like_fsdp2(options["float8_gather"])
    assert reached["fp8_gathered_weights"] == reached["float8_linears"] == 31
    assert reached["forward_weight_types"] == ["Float8TrainingTensor"]


def test_compile_matches_fsdp2(options):
    reached = _trained_like_fsdp2(options["compile"])
    calls = reached["compiled_calls"]
    assert calls["ours"] == calls["fsdp2"] == STEPS * 2 * (6 + 1)  # 2 micro-batches: 6 blocks and the loss


def test_explicit_buckets_match_fsdp2(options):
    reached = _trained_like_fsdp2(options["buckets"])
    plan, budget = reached["plan"], reached["budget"]
    assert plan["budgets"] == (budget, budget)
    assert any(len(b) >= 2 for b in plan["reduce"]) and len(plan["reduce"]) < len(plan["order"])
    assert all(c["reduce_scatter"] == 2 * len(plan["reduce"]) for c in reached["counts"][1:]), reached["counts"]
