"""torchao's FP8 all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True))
paired with HSDP and with DCP checkpoints (tests/harness/pair_fp8_workers.py). FP8 does
not train as fp32, so the reference is FSDP2 + torchao's own FP8 gather under the same
mesh and policy (bf16 parameters, fp32 reduction): losses and full gradients every step,
the parameters after. (FP8 gather x TP is refused by name: test_fp8.py.)"""
import pytest

from harness import run_distributed
from harness import fp8_workers
from harness import pair_fp8_workers as w

_MISSING = fp8_workers.torchao_missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"torchao does not import here: {_MISSING}")


def test_hsdp_fp8_gather_trains_like_fsdp2_with_torchaos_fp8_gather():
    """HSDP 2x2 (world 4), ZeRO-3 and ZeRO-2, against FSDP2 + torchao on the same 2-D mesh;
    every unit gathers FP8 over the shard dim, the replicas agree, scales are torchao's."""
    report = run_distributed(w.hsdp_fp8_vs_fsdp2, 4, ["optim_grads_params", "optim_grads"], timeout=300)[0]
    assert all(r["loss"] <= 1e-6 and r["grad"] <= 1e-6 for r in report.values()), report


def test_fp8_gather_checkpoints_resume_exactly_and_move_to_fsdp2(tmp_path):
    """DCP save under the FP8 gather (model and AdamW state), resumed into fresh models:
    ours continues bit for bit as uninterrupted; FSDP2 + torchao from our checkpoint and
    ours from FSDP2's continue as FSDP2's uninterrupted run; a plain module loads it."""
    report = run_distributed(w.fp8_dcp_resume, 2, str(tmp_path), timeout=300)[0]
    assert report["loss"] <= 1e-6 and report["grad"] <= 1e-6, report


def test_moe_with_fp8_gathered_dense_layers_trains_like_fsdp2_with_torchao():
    """MoE blocks at world 4, ep 2 (experts on the 2-rank expert mesh by FSDP2's
    ShardPlacementResult, the rest over the 4-rank mesh) whose dense Linears gather FP8:
    each block's dense unit gathers its weight in FP8 and its expert unit in bf16, and
    losses, every step's full gradients and the values equal FSDP2 + torchao's."""
    report = run_distributed(w.moe_fp8_gather_vs_fsdp2, 4, timeout=300)[0]
    assert report["moved"] > 0.01, report
    assert report["loss"] <= 1e-6 and report["grad"] <= 1e-6 and report["value"] <= 1e-6, report
