"""CPU offload (fully_shard(offload_policy=CPUOffloadPolicy())) on Gloo: the shards, their
gradients and the optimizer state in host memory, the same training as without it.

On a CPU-only machine the device is the CPU too, so these test the plumbing: the shard
copied in at each gather (from the bf16 copy-out when fresh), the reduced gradient copied
out into a kept host buffer, accumulation into offloaded gradients, the host optimizer.
Every scenario trains against the single-process reference (FSDP2 under the same policy
for bf16) and checks losses, full gradients every step and the final parameters."""
import pytest
import torch

from harness import run_distributed
from harness.offload_workers import offload_plumbing, offload_state_dicts
from harness.workers import check_parity_results, train_parity

SCENARIOS = {
    "offload_torch_adamw": {"offload": True},
    "offload_cpu_adamw": {"offload": True, "optimizer": "cpu_adamw"},
    "offload_sgd": {"offload": True, "optimizer": "sgd"},
    "offload_no_sync_accumulation": {"offload": True, "micro_batches": 2},
    "offload_accumulate_synced": {"offload": True, "micro_batches": 2, "sync_every_micro": True},
    "offload_clip": {"offload": True, "clip": 0.05, "optimizer": "cpu_adamw"},
    "offload_tied_unused_frozen": {"offload": True, "tie": True, "unused": True, "frozen": True},
    "offload_no_reshard_after_forward": {"offload": True, "reshard_after_forward": False},
    "offload_bf16_cpu_adamw": {"offload": True, "optimizer": "cpu_adamw", "param_dtype": torch.bfloat16,
                               "reduce_dtype": torch.float32, "lr": 1e-3},
    "partial_offload": {"offload": "blocks", "optimizer": "cpu_adamw"},
    # The step runs on the host beside the next forward (each gather waits for its unit).
    "offload_overlapped_step": {"offload": True, "optimizer": "cpu_adamw_overlap", "clip": 0.05},
    "offload_overlapped_step_bf16_accumulation": {
        "offload": True, "optimizer": "cpu_adamw_overlap", "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32, "lr": 1e-3, "micro_batches": 2, "sync_every_micro": True},
    "partial_offload_overlapped_step": {"offload": "blocks", "optimizer": "cpu_adamw_overlap"},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_offload_parity(name):
    opts = dict(SCENARIOS[name], steps=4)
    check_parity_results(run_distributed(train_parity, 2, opts, timeout=240), steps=4)


def test_offload_parity_world4_buckets():
    opts = {"offload": True, "optimizer": "cpu_adamw", "gather_bucket_bytes": 1 << 20, "reduce_bucket_bytes": 1 << 20,
            "micro_batches": 2, "clip": 0.05, "steps": 4}
    check_parity_results(run_distributed(train_parity, 4, opts, timeout=240), steps=4)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_offload_plumbing(param_dtype):
    run_distributed(offload_plumbing, 2, {"param_dtype": param_dtype}, timeout=180)


def test_offload_state_dicts_and_checkpoints(tmp_path):
    run_distributed(offload_state_dicts, 2, {"path": str(tmp_path)}, timeout=240)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_fsdp_config_offload_fraction(fraction):
    from harness.offload_workers import offload_config

    run_distributed(offload_config, 2, {"fraction": fraction}, timeout=180)


def test_overlapped_step_contract():
    from harness.offload_workers import overlapped_step_contract

    run_distributed(overlapped_step_contract, 2, {}, timeout=180)
