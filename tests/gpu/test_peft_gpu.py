"""PEFT LoRA merges into sharded weights with CUDA tensors on the GPU suite's backend:
PEFT's merge_adapter / unmerge_adapter (also with safe_merge), verl's merge with a host
backup restored, and merge_and_unload, against one plain process (harness/peft_workers.py)."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness.peft_workers import adapter_workflow, lora_merge

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers", reason="the PEFT tests need transformers")
pytest.importorskip("peft", reason="the PEFT tests need peft")
WORLD = gpu_world()


@pytest.mark.parametrize("flow", ["merge_adapter", "verl_backup", "merge_and_unload"])
def test_lora_merge_matches_one_process_gpu(flow):
    assert run_distributed(lora_merge, WORLD, "llama", flow, "ours", **gpu_launch(), timeout=240) == [True] * WORLD


@pytest.mark.dtensor_collectives  # PEFT's adapter state dict: full_tensor() of torch's DTensors
def test_adapter_workflow_matches_one_process_gpu(tmp_path):
    assert run_distributed(adapter_workflow, WORLD, str(tmp_path), **gpu_launch(), timeout=240) == [True] * WORLD


def test_lora_bias_merge_matches_one_process_gpu():
    assert run_distributed(lora_merge, WORLD, "llama", "merge_adapter", "ours", "optim_grads_params", True,
                           **gpu_launch(), timeout=240) == [True] * WORLD


@pytest.mark.parametrize("lora_bias", [False, True])
def test_lora_safe_merge_matches_one_process_gpu(lora_bias):
    """safe_merge=True: the full delta added to a clone of `.data`, assigned back; the
    LoRA bias merged through `bias + lora_B.bias * scaling`."""
    assert run_distributed(lora_merge, WORLD, "llama", "safe_merge", "ours", "optim_grads_params", lora_bias,
                           **gpu_launch(), timeout=240) == [True] * WORLD
