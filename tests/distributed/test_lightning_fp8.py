"""torchao's FP8 all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True)) under
Lightning's ModelParallelStrategy, the Lightning code the same for FSDP2 + torchao and for
ours (tests/harness/lightning_feature_workers.py): Net(hidden=16)'s block Linears converted
with torchao's convert_to_float8_training before fully_shard (in Fabric's parallelize
function; in the LightningModule's configure_model), bf16 parameters and fp32 reduction,
torchao's precompute_float8_dynamic_scale_for_fsdp after each optimizer step (a no-op on
ours). World 2, Gloo.

- Fabric: 3 SGD steps; once plain, once with 2 micro-batches a step (the first under
  fabric.no_backward_sync) and fabric.clip_gradients by norm acting at every step.
- Trainer.fit: 2 epochs, accumulate_grad_batches=2 (4 optimizer steps of 8 micro-batches),
  gradient_clip_algorithm="value" acting.

Ours against FSDP2 + torchao: every (micro-batch) loss, the full gradient the optimizer
applies (after the clip) at every step, the full values after every step and the clip
norm, bit for bit (measured). Where the gradient is clipped by norm the tolerance is 1e-6:
the two systems sum the norm's squares in different orders, and a one-ulp norm moves every
clipped gradient by ~1e-7 (measured under Trainer.fit with gradient_clip_algorithm="norm":
its third step's norm 0x1.2e286ap-1 against FSDP2's 0x1.2e2868p-1, 1.8e-7 on the gradients).
The FP8 gather is in effect: every block unit of ours gathers its two weights in FP8 (its
gather transform, a byte gather) and nothing else, FSDP2's hold torchao's FP8-gathering
weights, and every Float8Linear forward of every step saw torchao's Float8TrainingTensor
weight, in both systems."""
import pytest

from harness import lightning_feature_workers as w
from harness import run_distributed
from harness.fp8_workers import torchao_missing

_MISSING = torchao_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchao does not import here: {_MISSING}")

STEPS = 3
CLIP_NORM = ("norm", 0.3)  # below every step's gradient norm (0.63-0.83): the clip acts
NORM_CLIP_TOL = 1e-6
FP8 = "Float8TrainingTensor"
CONFIGS = [dict(name="fp8", feature="fp8", plain=False),
           dict(name="fp8_accumulate_clip", feature="fp8", plain=False, accum=2, clip=CLIP_NORM)]


def test_lightning_fabric_fp8_gather_trains_like_fsdp2_with_torchao():
    results = run_distributed(w.fabric_features, 2, CONFIGS, steps=STEPS, timeout=300)[0]
    for cfg in CONFIGS:
        name, out = cfg["name"], results[cfg["name"]]
        tol = NORM_CLIP_TOL if cfg.get("clip") else 0.0
        bad = {k: v for k, v in out["vs_fsdp2"].items() if not v <= tol}
        assert not bad, f"{name}: ours vs FSDP2 + torchao: {bad} (all: {out['vs_fsdp2']})"
        assert out["ours"]["moved"] > 0.05, out["ours"]["moved"]
        for impl in ("fsdp2", "ours"):
            assert out[impl]["option"] == [True] * 3, f"{name}: {impl}'s units {out[impl]['option']}"
            assert out[impl]["weight_types"] == [[FP8]] * STEPS, f"{name}: {impl} {out[impl]['weight_types']}"
    clipped = results["fp8_accumulate_clip"]
    assert len(clipped["fsdp2"]["norms"]) == STEPS and min(clipped["fsdp2"]["norms"]) > CLIP_NORM[1], clipped
    # fabric.no_backward_sync reached ours: a step of two backwards reduces as a step of one
    # (after the first step, whose bucket plan is not made yet).
    for step in range(1, STEPS):
        got, once = clipped["ours"]["counts"][step], results["fp8"]["ours"]["counts"][step]
        assert got["reduce_scatter"] == once["reduce_scatter"] > 0, (step, got, once)


def test_lightning_trainer_fp8_gather_trains_like_fsdp2_with_torchao(tmp_path):
    out = run_distributed(w.trainer_fp8_vs_fsdp2, 2, str(tmp_path), "value", 0.02, timeout=300)[0]
    assert out["sharded"] and out["steps"] == 4 and out["micro"] == 8, out
    assert out["vs_fsdp2"] == {"loss": 0.0, "norm": 0.0, "grad": 0.0, "param": 0.0}, out["vs_fsdp2"]
    assert out["clipped"] > 0 and out["moved"] > 0.05, out
    for impl in ("fsdp2", "ours"):
        assert out["option"][impl] == [True] * 3, (impl, out["option"])
        assert out["weight_types"][impl] == [FP8], (impl, out["weight_types"])
        assert out["forwards"][impl] == 4 * 8, (impl, out["forwards"])  # 4 Float8Linears, 8 micro-batches
