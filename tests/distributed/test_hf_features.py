"""Hugging Face models (tiny LlamaForCausalLM and Qwen3ForCausalLM from configs, tied
embeddings, fp32), each decoder layer and the root sharded as FSDP2 users do, under the
features the README's matrix had untested for them: ZeRO-1 and no shard, CPU offload
(ZeRO-3 and ZeRO-2) and torch.compile (aot_eager: each layer compiled with
fullgraph=True before sharding, torchtitan's way, also with offload; or the whole model
after sharding); explicit gather/reduce buckets that two units share (ours; the root's
bucket_budgets(), the buckets' members and one reduce-scatter per bucket checked);
tensor parallelism, dp 2 x tp 2 at world 4 (its own launch); greedy generate() after
training (tokens and logits) under offload, ZeRO-1 and no shard, before anything else
gathers the last step's values.
Left-padded batches with an attention mask and HF's own loss (`labels=`,
`num_items_in_batch=`). Every configuration trains against one plain process fed every
rank's rows: the loss, every full gradient and the global grad norm every step, the
parameters after; and against FSDP2 under the same code where FSDP2 runs the setting
(all but ZeRO-1; no shard is FSDP2 on a (world, 1) replicate x shard mesh). The
collectives of a steady step and the units' host buffers show each option acting
(tests/harness/hf_feature_workers.py). Under TP, FSDP2's grad norm is taken from the
full gradients: torch's clip_grad_norm_ fails there (it stacks norms on the 2-D and the
1-D mesh), as the Lightning tests found. One launch per architecture (and one for TP):
most of a launch is importing transformers in the ranks."""
import pytest

from harness import run_distributed

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")

CASES = {
    "llama": {
        "zero1": {"strategy": "optim", "fsdp2": False, "generate": True},  # FSDP2 has no ZeRO-1
        "no_shard": {"strategy": "no_shard"},
        "offload": {"offload": True, "generate": True},
        "compile_layers": {"compile": "layers"},
        "compile_layers_offload": {"compile": "layers", "offload": True},
        # Ours only: 50 kB gathers root + layer 0 (45 kB) in one bucket, layer 1 in another.
        "buckets": {"buckets": 50_000},
    },
    "qwen3": {
        "zero1": {"strategy": "optim", "fsdp2": False},
        "no_shard": {"strategy": "no_shard", "generate": True},
        "offload_zero2": {"offload": True, "strategy": "optim_grads", "generate": True},
        "compile_model": {"compile": "model"},
    },
}


@pytest.mark.parametrize("arch", list(CASES))
def test_hf_model_features_train_like_one_process_and_fsdp2(arch):
    from harness.hf_feature_workers import hf_features

    assert run_distributed(hf_features, 2, arch, CASES[arch], timeout=600) == [True, True]


def test_hf_llama_tensor_parallel_trains_like_one_process_and_fsdp2():
    """dp 2 x tp 2 (world 4): transformers' Llama TP plan (q, k, v, gate, up column-wise;
    o, down row-wise) through torch's parallelize_module on "tp", then fully_shard on
    "dp" (ours and FSDP2), against one plain process on all rows: losses, full gradients
    (ours' also rebuilt from the raw pieces), grad norms every step, values after."""
    from harness.hf_feature_workers import hf_features

    cases = {"tp": {"tp": True}}
    assert run_distributed(hf_features, 4, "llama", cases, timeout=600) == [True] * 4
