"""FP8 training (torchao's Float8Linear) under our fully_shard with CUDA tensors, on the GPU
suite's backend (tests/harness/fp8_workers.py):
  - the bf16 weight gather, tensorwise and rowwise recipes, against FSDP2 + torchao;
  - the FP8 weight gather (our gather transform and its fused CUDA kernels) against FSDP2 +
    torchao's FP8 gather; its bytes and scales bit for bit against torchao's quantization;
    uneven shards against one process (three ranks, Gloo on one GPU); the scales' refresh.
  - MXFP8 with block-aligned shards (emulated MX matmuls: no MX hardware before Blackwell):
    gathered data and scales bit for bit against torchao, training against FSDP2 + torchao.
Losses, gradients and parameters step by step."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import fp8_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


@pytest.fixture(autouse=True)
def _torchao():
    missing = w.torchao_missing()
    if missing:
        pytest.skip(f"torchao does not import here: {missing}")


def test_float8_linear_trains_like_fsdp2_with_torchao_gpu():
    report = run_distributed(w.float8_linear_parity, WORLD, ["tensorwise", "rowwise"], **GPU, timeout=300)[0]
    assert set(report) == {"tensorwise", "rowwise"}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_fp8_gather_trains_like_fsdp2_with_torchaos_fp8_gather_gpu(strategy):
    report = run_distributed(w.float8_gather_parity, WORLD, 3, strategy, **GPU, timeout=300)[0]
    assert report["loss"] <= 1e-6 and report["grad"] <= 1e-6


def test_fp8_gathered_bytes_and_scales_are_torchaos_bit_for_bit_gpu():
    checked = run_distributed(w.float8_gather_bits, WORLD, **GPU, timeout=300)[0]
    assert checked["a.weight"] == 1024 * 4112


def test_fp8_gather_with_uneven_shards_matches_one_process_gpu():
    # Three ranks share the GPU over Gloo whatever the suite's backend (NCCL takes one rank a GPU).
    report = run_distributed(w.float8_gather_uneven, 3, backend="gloo", device="cuda", timeout=300)[0]
    assert report["grad"] <= 1e-5


def test_fp8_gather_under_torch_compile_trains_as_eager_gpu():
    run_distributed(w.float8_gather_compiled, WORLD, "inductor", **GPU, timeout=400)


def test_fp8_scales_follow_the_shards_gpu():
    run_distributed(w.float8_gather_scales, WORLD, **GPU, timeout=300)


def _mx():
    missing = w.mx_missing()
    if missing:
        pytest.skip(f"torchao's MXFP8 training does not import here: {missing}")


def test_mxfp8_block_aligned_gather_is_torchaos_quantization_bit_for_bit_gpu():
    _mx()
    checked = run_distributed(w.mx_gather_bits, WORLD, **GPU, timeout=300)[0]
    assert checked == {"up.weight": 160 * 64, "down.weight": 96 * 160, "out.weight": 32 * 96}


def test_mxfp8_gather_trains_like_fsdp2_with_torchao_mxfp8_gpu():
    _mx()
    report = run_distributed(w.mx_parity, WORLD, **GPU, timeout=300)[0]
    assert report["first_loss_err"] == 0.0 and report["loss"] <= 2e-2
