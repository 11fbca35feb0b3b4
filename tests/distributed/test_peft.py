"""PEFT LoRA adapters on sharded Hugging Face models: training, then merging the adapters
into the base weights and back (PEFT's merge_adapter / unmerge_adapter, with and without
safe_merge, verl's merge of
an FSDP2 model with and without a host backup, merge_and_unload), on ours and on FSDP2
under the same code, each against one plain process (harness/peft_workers.py)."""
import pytest

from harness import run_distributed
from harness.peft_workers import bf16_merge, lora_merge

pytest.importorskip("transformers", reason="the PEFT tests need transformers (test extra)")
pytest.importorskip("peft", reason="the PEFT tests need peft (test extra)")


# FSDP2 fails verl's restore from the host backup on the CPU (copy_ of a plain tensor into
# a DTensor's .data: "mixed torch.Tensor and DTensor"); ours runs it.
@pytest.mark.parametrize("flow,system", [(flow, system) for flow in ("merge_adapter", "verl", "verl_backup",
                                                                      "merge_and_unload")
                                         for system in ("ours", "fsdp2") if (flow, system) != ("verl_backup", "fsdp2")])
def test_lora_merge_matches_one_process(flow, system):
    assert run_distributed(lora_merge, 2, "llama", flow, system, timeout=240) == [True] * 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_merge_uneven_pieces(arch):
    """World 3: pieces of uneven length, some ranks holding none of a small weight."""
    assert run_distributed(lora_merge, 3, arch, "verl", "ours", timeout=240) == [True] * 3


@pytest.mark.parametrize("system", ["ours", "fsdp2"])
def test_bf16_merge_on_the_cpu(system):
    """PEFT's CPU path for bf16 adapters: `weight.float()` of each, then their product."""
    assert run_distributed(bf16_merge, 2, "llama", system, timeout=240) == [True] * 2


# FSDP2 without resharding after forward leaves the layers holding their gathered
# parameters after the merged model's forward; PEFT's unmerge then writes those, not the
# shards, and the model stays merged, silently (strict xfail: it would pass if FSDP2 changed).
@pytest.mark.parametrize("strategy,system", [
    ("optim_grads", "ours"), pytest.param("optim_grads", "fsdp2", marks=pytest.mark.xfail(
        strict=True, reason="FSDP2's unmerge writes the gathered parameters kept after forward")),
    ("no_shard", "ours"), ("no_shard", "fsdp2"), ("offload", "ours"), ("offload", "fsdp2")])
def test_lora_merge_under_other_strategies(strategy, system):
    """verl's merge and unmerge under ZeRO-2, replication and CPU offload: the kept
    gathered copy (ZeRO-2), the replicated shard and the host shard take the merged values."""
    assert run_distributed(lora_merge, 2, "llama", "verl", system, strategy, timeout=240) == [True] * 2


def test_adapter_added_after_sharding_is_refused_at_the_step():
    from harness.peft_workers import adapter_added_after_sharding

    assert run_distributed(adapter_added_after_sharding, 2, timeout=240) == [True] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_adapter_workflow_matches_one_process(world, tmp_path):
    from harness.peft_workers import adapter_workflow

    assert run_distributed(adapter_workflow, world, str(tmp_path), timeout=240) == [True] * world


# PEFT's safe merge adds the full delta to a clone of the base weight's `.data`, checks it
# for NaNs, and assigns it back. FSDP2's merged weights come out wrong (0.06 off at world
# 2, silently: strict xfail, it would pass if FSDP2 changed).
@pytest.mark.parametrize("world,lora_bias,system", [
    (2, False, "ours"), (3, False, "ours"), (2, True, "ours"), (3, True, "ours"),
    pytest.param(2, False, "fsdp2", marks=pytest.mark.xfail(
        strict=True, reason="FSDP2's safe merge writes wrong base weights"))])
def test_lora_safe_merge(world, lora_bias, system):
    assert run_distributed(lora_merge, world, "llama", "safe_merge", system, "optim_grads_params", lora_bias,
                           timeout=240) == [True] * world


@pytest.mark.parametrize("system", ["ours", "fsdp2"])
@pytest.mark.parametrize("world", [2, 3])
def test_lora_bias_merge(system, world):
    """LoRA with its own bias (lora_bias=True): merge() also adds lora_B.bias * scaling to
    the base bias's .data, a piece of another parameter laid out differently."""
    assert run_distributed(lora_merge, world, "llama", "merge_adapter", system, "optim_grads_params", True,
                           timeout=240) == [True] * world
