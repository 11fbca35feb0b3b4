"""torchao's FP8 all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True)) on a
Hugging Face model (a tiny LlamaForCausalLM from a config, its decoder projections
converted to Float8Linear), each decoder layer and the root sharded, bf16 parameters and
fp32 reduction: the same client code under ours and under FSDP2 + torchao's own FP8
gather (tests/harness/hf_fp8_workers.py)."""
import pytest

from harness import run_distributed
from harness import fp8_workers

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")
_MISSING = fp8_workers.torchao_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchao does not import here: {_MISSING}")


def test_hf_llama_fp8_gather_trains_like_fsdp2_with_torchaos_fp8_gather():
    """HF's `labels=` loss on left-padded masked rows, AdamW, torchao's precompute after
    each step (both systems): each rank's loss, every full gradient every step and every
    parameter after 3 steps equal FSDP2 + torchao's bit for bit; our layer units gather
    their 7 projection weights in FP8 with torchao's scales, and every Float8Linear
    forward (ours and FSDP2's) sees a Float8TrainingTensor weight."""
    from harness.hf_fp8_workers import hf_fp8_gather_vs_fsdp2

    report = run_distributed(hf_fp8_gather_vs_fsdp2, 2, timeout=300)[0]
    assert report["grad"] == report["value"] == 0.0, report
    assert report["moved"] > 1e-3, report
