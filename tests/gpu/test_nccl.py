"""The distributed suite on NCCL (2 GPUs), plus stream-race and device checks."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import gpu_workers as GW
from harness import workers as W

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)

# The Gloo scenarios, with unused and frozen parameters combined, plus fused AdamW.
NCCL_SCENARIOS = {k: v for k, v in W.PARITY_SCENARIOS.items() if k not in ("unused_params", "frozen_params")}
NCCL_SCENARIOS["unused_frozen"] = {"unused": True, "frozen": True}
NCCL_SCENARIOS["fused_adamw"] = {"fused": True}
# Buckets: every unit in one coalesced all-gather (fp32, and bf16 cast in place) and one
# coalesced reduce-scatter (fp32; bf16 gradients reduced in fp32; with accumulation).
NCCL_SCENARIOS["gather_buckets"] = {"gather_bucket_bytes": 1 << 30}
NCCL_SCENARIOS["gather_buckets_bf16"] = dict(W.PARITY_SCENARIOS["bf16_mixed_precision"], gather_bucket_bytes=1 << 30)
NCCL_SCENARIOS["reduce_buckets"] = {"reduce_bucket_bytes": 1 << 30, "micro_batches": 2, "sync_every_micro": True}
# Accumulated without sync, reduced through the bucket by finish_grad_sync().
NCCL_SCENARIOS["reduce_buckets_finish_grad_sync"] = {"reduce_bucket_bytes": 1 << 30, "micro_batches": 2,
                                                     "finish_grad_sync": True}
NCCL_SCENARIOS["buckets_bf16"] = dict(W.PARITY_SCENARIOS["bf16_mixed_precision"], gather_bucket_bytes=1 << 30,
                                      reduce_bucket_bytes=1 << 30)


@pytest.mark.parametrize("name", list(NCCL_SCENARIOS))
def test_nccl_parity(name):
    opts = dict(NCCL_SCENARIOS[name], steps=5)
    results = run_distributed(W.train_parity, WORLD, opts, **GPU, timeout=300)
    W.check_parity_results(results, steps=5)


@pytest.mark.parametrize("name", ["adamw", "bf16_mixed_precision", "grad_accumulation", "buckets_bf16"])
def test_nccl_parity_under_stream_chaos(name):
    opts = dict(NCCL_SCENARIOS[name], steps=5)
    results = run_distributed(GW.train_parity_with_stream_chaos, WORLD, opts, **GPU, timeout=300)
    W.check_parity_results(results, steps=5)


def test_nccl_tiny_odd_params():
    errs = run_distributed(W.train_tiny_parity, WORLD, {}, **GPU, timeout=300)
    assert max(errs) <= 1e-6


def test_nccl_api_semantics():
    run_distributed(W.api_semantics, WORLD, **GPU, timeout=300)


def test_nccl_eval_forward_reshards():
    run_distributed(W.world_one_and_eval, WORLD, **GPU, timeout=300)


def test_cuda_device_errors():
    run_distributed(GW.cuda_device_errors, WORLD, **GPU, timeout=300)


def test_memory_released_after_step():
    run_distributed(GW.unsharded_memory_released, WORLD, **GPU, timeout=300)


def test_nccl_uneven_collectives():
    checked = run_distributed(W.uneven_collectives, WORLD, ["AUTO", "GROUPED", "PADDED", "ALL_REDUCE"],
                              **GPU, timeout=300)
    assert all(c == 24 for c in checked)


def test_nccl_large_all_gather_v_takes_the_padded_path():
    chosen = run_distributed(W.large_all_gather_v_auto, WORLD, **GPU, timeout=300)
    assert chosen == ["PADDED"] * WORLD
