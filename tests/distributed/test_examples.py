"""The examples run end to end on CPU + Gloo (functional checks, tiny sizes)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(nproc, script, *args, port):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           str(ROOT / "examples" / script), "--device", "cpu", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_megatron_style_resumes_under_another_strategy_and_world(tmp_path):
    if not (ROOT / "examples" / "megatron_style.py").exists():
        pytest.skip("examples/ is not part of this checkout")
    small = ["--hidden-size", "64", "--num-layers", "2", "--seq-length", "32", "--global-batch-size", "4"]
    ckpt = str(tmp_path / "ckpt")
    out = _torchrun(2, "megatron_style.py", "--train-iters", "4", "--save", ckpt, *small, port=29581)
    assert "saved a sharded checkpoint" in out
    out = _torchrun(1, "megatron_style.py", "--train-iters", "6", "--load", ckpt,
                    "--data-parallel-sharding-strategy", "no_shard", *small, port=29582)
    assert "starting at iteration 4" in out and "iteration    5" in out
