"""Sharding strategies and DCP checkpoints on 2 GPUs (NCCL)."""
import pytest
import torch

from harness import gpu_launch, gpu_world, run_distributed
from harness import strategy_workers as SW
from harness.workers import check_parity_results, train_parity

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)

EVERYTHING = {"tie": True, "unused": True, "frozen": True, "micro_batches": 2, "clip": 0.05, "steps": 4}
# Against FSDP2 under the same policy: AdamW, then SGD (momentum) with clipping.
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "lr": 1e-3, "micro_batches": 2, "steps": 4,
        "extra_runs": [{"optimizer": "sgd", "clip": 0.05}]}


@pytest.mark.long_gpu
@pytest.mark.parametrize("strategy", SW.STRATEGIES)
def test_nccl_strategy_parity(strategy):
    for opts in (EVERYTHING, BF16):
        results = run_distributed(train_parity, WORLD, dict(opts, strategy=strategy), **GPU, timeout=300)
        check_parity_results(results, steps=4)
    run_distributed(SW.strategy_api, WORLD, strategy, **GPU, timeout=300)


@pytest.mark.long_gpu
def test_nccl_peak_memory_orders_with_strategy():
    peaks = {s: run_distributed(SW.strategy_peak_memory, WORLD, s, **GPU, timeout=300)[0] for s in SW.STRATEGIES}
    p = {s: r["peak"] for s, r in peaks.items()}
    gap = 0.25 * peaks["no_shard"]["param_bytes"]  # each step down sheds ~half the params' bytes
    print({s: f"{v / 2**20:.0f} MiB" for s, v in p.items()})
    assert p["no_shard"] >= p["optim"] + gap, p
    assert p["optim"] >= p["optim_grads"] + gap, p
    assert p["optim_grads"] >= p["optim_grads_params"] + gap, p


@pytest.mark.long_gpu
def test_nccl_checkpoints(tmp_path):
    path = str(tmp_path / "zero3")
    run_distributed(SW.checkpoint_save, WORLD, "optim_grads_params", path, **GPU, timeout=300)
    # Another strategy at the same world, other worlds (1 rank; 2 when saved at more), another ZeRO stage.
    resumes = [(WORLD, "no_shard"), (1, "optim_grads_params"), (WORLD, "optim_grads")]
    if WORLD > 2:
        resumes.append((2, "optim_grads_params"))
    for world, strategy in resumes:
        run_distributed(SW.checkpoint_resume, world, strategy, path, saved_world=WORLD, **GPU, timeout=300)
    run_distributed(SW.checkpoint_bitwise_resume, WORLD, "optim_grads_params", str(tmp_path / "bitwise"),
                    **GPU, timeout=300)


def test_nccl_megatron_config():
    run_distributed(SW.megatron_config_parity, WORLD, {"bf16": False, "data_parallel_sharding_strategy": "optim_grads"},
                    **GPU, timeout=300)


# ZeRO-3 too: an activation-checkpoint recompute in backward must not prefetch units
# whose gradients are already reduced (they would serve pre-step weights next step).
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_nccl_kept_copies_follow_fused_steps_and_data_writes(strategy):
    for recompute in (False, True):
        run_distributed(SW.kept_copies_follow_every_write, WORLD, strategy, recompute, **GPU, timeout=300)


def test_nccl_checkpoint_odd_params(tmp_path):
    run_distributed(SW.checkpoint_odd_params, WORLD, str(tmp_path / "ckpt"), "optim_grads_params", **GPU,
                    timeout=300)
