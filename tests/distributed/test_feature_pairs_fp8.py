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
