"""FP8 training with torchao's Float8Linear under our fully_shard, on Gloo (CI installs
torchao):
  - the bf16 weight gather, tensorwise and rowwise recipes, against FSDP2 + torchao;
  - the FP8 weight gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True), served
    by our gather transform, fp8.py) against FSDP2 + torchao's own FP8 gather, for every
    strategy; with uneven shards (where FSDP2 + torchao aborts) against one process using
    torchao's quantization; its bytes, scales, memory estimate and refusals;
  - MXFP8 (torchao's MXFP8TrainingOpConfig, emulated matmuls) with block-aligned shards:
    the gathered data and E8M0 scales against torchao's quantization of the whole weight,
    training against FSDP2 + torchao's MXFP8 (bf16 gather).
Losses, full gradients and parameters are compared step by step."""
import pytest

from harness import run_distributed
from harness import fp8_workers as w

_MISSING = w.torchao_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchao does not import here: {_MISSING}")


def test_float8_linear_trains_like_fsdp2_with_torchao():
    report = run_distributed(w.float8_linear_parity, 2, ["tensorwise", "rowwise"], timeout=300)[0]
    assert set(report) == {"tensorwise", "rowwise"}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "no_shard"])
def test_fp8_gather_trains_like_fsdp2_with_torchaos_fp8_gather(strategy):
    report = run_distributed(w.float8_gather_parity, 2, 3, strategy, timeout=300)[0]
    assert report["loss"] <= 1e-6 and report["grad"] <= 1e-6


def test_fp8_gather_with_uneven_shards_and_a_tiny_weight_matches_one_process():
    report = run_distributed(w.float8_gather_uneven, 3, timeout=300)[0]
    assert report["grad"] <= 1e-5


def test_fp8_gathered_bytes_and_scales_are_torchaos_bit_for_bit():
    checked = run_distributed(w.float8_gather_bits, 3, timeout=300)[0]
    assert checked["a.weight"] == 1024 * 4112


def test_fp8_gather_halves_the_gathered_bytes():
    report = run_distributed(w.float8_gather_bytes, 2, timeout=300)[0]
    fp8, bf16 = report["fp8"], report["bf16"]
    assert fp8["calls"] == bf16["calls"] == 5  # forward: 3 units; backward: the 2 resharded again
    # Weights take 1 byte an element instead of 2, biases stay bf16 (and Gloo pads the
    # uneven byte segments to the longest): a bit over half.
    assert 0.5 < fp8["bytes"] / bf16["bytes"] <= 0.52, report
    assert 0.5 <= fp8["contributed"] / bf16["contributed"] <= 0.51, report
    assert all(0.5 < a / b <= 0.51 for a, b in zip(fp8["unsharded"], bf16["unsharded"])), report


def test_fp8_gather_under_torch_compile_trains_as_eager():
    run_distributed(w.float8_gather_compiled, 2, "aot_eager", timeout=300)


def test_fp8_scales_follow_the_shards():
    run_distributed(w.float8_gather_scales, 2, timeout=300)


def test_estimate_memory_counts_the_fp8_gather_buffers():
    report = run_distributed(w.float8_gather_estimate, 2, timeout=300)[0]
    assert report["fp8"] < 0.52 * report["bf16"]


def test_other_gather_extensions_tp_and_mixed_fp8_dtypes_are_refused():
    run_distributed(w.float8_gather_refusals, 2, timeout=120)


_MX_MISSING = w.mx_missing()
needs_mx = pytest.mark.skipif(bool(_MX_MISSING), reason=f"torchao's MXFP8 training does not import: {_MX_MISSING}")


@needs_mx
def test_mxfp8_block_aligned_gather_is_torchaos_quantization_bit_for_bit():
    checked = run_distributed(w.mx_gather_bits, 3, timeout=300)[0]
    assert checked == {"up.weight": 160 * 64, "down.weight": 96 * 160, "out.weight": 32 * 96}


@needs_mx
def test_mxfp8_gather_trains_like_fsdp2_with_torchao_mxfp8():
    report = run_distributed(w.mx_parity, 2, timeout=300)[0]
    assert report["first_loss_err"] == 0.0 and report["loss"] <= 2e-2


@needs_mx
def test_mxfp8_estimate_and_refusals():
    run_distributed(w.mx_estimate, 2, timeout=300)
    run_distributed(w.mx_refusals, 2, timeout=300)
