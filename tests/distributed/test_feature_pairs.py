"""Pairs of features the README's matrix had marked untested, each trained against one
plain process fed every rank's rows (tests/harness/pair_workers.py): losses, every step's
full gradients, the parameters after. torch.compile (aot_eager, the whole model) with
ZeRO-2, ZeRO-1, no sharding, HSDP, CPU offload, buckets and a DCP resume into a fresh
compiled model; HSDP with CPU offload; a Hugging Face Llama with ZeRO-2 and with HSDP;
tensor parallelism (dp 2 x tp 2, sequence parallel) under torch.compile."""
import pytest

from harness import run_distributed
from harness.pair_workers import pair_vs_one_process, tp_compiled_vs_one_process

CASES = {
    "compile_zero2": (2, {"compile": True, "strategy": "optim_grads"}),
    "compile_zero1": (2, {"compile": True, "strategy": "optim"}),
    "compile_no_shard": (2, {"compile": True, "strategy": "no_shard"}),
    "compile_hsdp": (4, {"compile": True, "hsdp": True}),
    "compile_offload": (2, {"compile": True, "offload": True}),
    "compile_buckets": (2, {"compile": True, "buckets": True}),
    "compile_dcp_resume": (2, {"compile": True, "dcp": True}),
    "compile_zero2_dcp_resume": (2, {"compile": True, "strategy": "optim_grads", "dcp": True}),
    "hsdp_offload": (4, {"hsdp": True, "offload": True}),
    "buckets_dcp_resume": (2, {"buckets": True, "dcp": True}),
    "hf_llama_zero2": (2, {"hf": True, "strategy": "optim_grads"}),
    "hf_llama_hsdp": (4, {"hf": True, "hsdp": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_feature_pair_trains_like_one_process(name, tmp_path):
    world, case = CASES[name]
    if case.get("hf"):
        pytest.importorskip("transformers", reason="the Hugging Face cases need transformers (test extra)")
    assert run_distributed(pair_vs_one_process, world, name, case, str(tmp_path), timeout=300) == [True] * world


def test_tensor_parallel_under_compile_trains_like_one_process():
    """dp 2 x tp 2 with sequence parallel, ZeRO-3 on "dp_shard", the whole model under
    torch.compile (aot_eager): losses, full gradients and clipped norms every step, values
    after, against one plain process; a compiled graph holds the TP block."""
    report = run_distributed(tp_compiled_vs_one_process, 4, [{"sp": True}], timeout=600)[0]
    assert report[0]["graphs"] > 0, report
