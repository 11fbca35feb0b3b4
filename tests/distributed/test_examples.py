"""The examples run end to end on CPU + Gloo (functional checks, tiny sizes)."""
from pathlib import Path

import pytest

from megatron_fsdp_ext.testing.launcher import run_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_megatron_style_resumes_under_another_strategy_and_world(tmp_path):
    script = EXAMPLES / "megatron_style.py"
    if not script.exists():
        pytest.skip("examples/ is not part of this checkout")
    small = ["--device", "cpu", "--hidden-size", "64", "--num-layers", "2", "--seq-length", "32",
             "--global-batch-size", "4"]
    ckpt = str(tmp_path / "ckpt")
    out = run_script(2, script, "--train-iters", "4", "--save", ckpt, *small, port=29581)
    assert "saved a sharded checkpoint" in out
    out = run_script(1, script, "--train-iters", "6", "--load", ckpt, "--data-parallel-sharding-strategy", "no_shard",
                     *small, port=29582)
    assert "starting at iteration 4" in out and "iteration    5" in out
