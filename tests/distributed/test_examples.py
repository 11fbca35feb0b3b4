"""The examples run end to end on CPU + Gloo (tiny sizes) and are checked by their numbers:
the loss falls below a bound derived from the data, the checkpoint loads into the plain
model and reproduces the reported held-out loss, a resumed run continues the saved one."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from harness.launcher import run_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UNIFORM_LOSS = math.log(256)  # byte vocabulary: the loss of a uniform guess, about where training starts


def example(name):
    script = EXAMPLES / name
    if not script.exists():
        pytest.skip("examples/ is not part of this checkout")
    return script


def import_train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", example("train_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def unigram_entropy(tokens):
    """Loss (nats/byte) of the best model that ignores context: the byte frequencies."""
    p = torch.bincount(tokens, minlength=256).double()
    p = p[p > 0] / p.sum()
    return -(p * p.log()).sum().item()


def test_train_gpt_learns_and_its_checkpoint_loads_into_the_plain_model(tmp_path):
    train_gpt = import_train_gpt()
    metrics_path = tmp_path / "metrics.json"
    run_script(2, example("train_gpt.py"), "--device", "cpu", "--steps", "40", "--seq-len", "32",
               "--micro-batch", "4", "--d-model", "64", "--layers", "2", "--heads", "4", "--corpus-mb", "1",
               "--out-dir", str(tmp_path), "--metrics-json", str(metrics_path), port=29583, timeout=150)
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["losses"]
    assert metrics["world"] == 2 and len(losses) == 40
    assert abs(losses[0] - UNIFORM_LOSS) < 0.5, losses[0]  # initialised near a uniform guess

    # The bound: three quarters of the way from a uniform guess to the byte-unigram model
    # of the training text (3.16 nats on CPython's stdlib); 40 steps reach about 3.1.
    corpus = train_gpt.load_corpus(metrics["corpus_bytes"])
    train_part = corpus[: corpus.numel() - corpus.numel() // 20]
    unigram = unigram_entropy(train_part)
    bound = unigram + (UNIFORM_LOSS - unigram) / 4
    assert metrics["held_out_loss"] < bound, (metrics["held_out_loss"], bound)

    # The full-state-dict checkpoint is a plain LlamaModel's state dict: every key, every
    # shape (strict), and it gives the held-out loss the sharded model reported.
    saved = torch.load(metrics["checkpoint"], weights_only=False)
    plain = LlamaModel(LlamaConfig(**saved["config"]))
    plain.load_state_dict(saved["model"], strict=True)
    tokens, targets = train_gpt.held_out_batch(corpus, metrics["seq_len"])
    with torch.no_grad():
        plain_loss = plain.loss(tokens, targets).item()
    assert plain_loss == pytest.approx(metrics["held_out_loss"], rel=1e-5, abs=1e-5)


def test_megatron_style_resumes_under_another_strategy_and_world(tmp_path):
    script = example("megatron_style.py")
    small = ["--device", "cpu", "--hidden-size", "64", "--num-layers", "2", "--seq-length", "32",
             "--global-batch-size", "4", "--train-iters", "6"]
    ckpt = str(tmp_path / "ckpt")
    # ZeRO-3 on two ranks, checkpoints after iterations 4 and 6.
    run_script(2, script, "--save", ckpt, "--save-interval", "4", "--metrics-json", str(tmp_path / "full.json"),
               *small, port=29581, timeout=150)
    full = json.loads((tmp_path / "full.json").read_text())
    assert full["start_iteration"] == 0 and full["saved_iterations"] == [4, 6]
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    full_losses = dict(full["losses"])
    assert sorted(full_losses) == list(range(6))
    assert abs(full_losses[0] - UNIFORM_LOSS) < 0.5, full_losses[0]
    assert full_losses[5] < UNIFORM_LOSS - 0.5, full_losses  # six AdamW steps at lr 3e-3 reach about 4.4

    # Resume iteration 4 on one rank without sharding: the same data stream continues, so
    # iterations 4 and 5 must repeat the uninterrupted run's losses. Iteration 4's loss
    # depends only on the loaded weights; iteration 5's also on the loaded AdamW state.
    run_script(1, script, "--load", ckpt, "--ckpt-step", "4", "--data-parallel-sharding-strategy", "no_shard",
               "--metrics-json", str(tmp_path / "resumed.json"), *small, port=29582, timeout=150)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["start_iteration"] == 4 and resumed["strategy"] == "no_shard" and resumed["world"] == 1
    resumed_losses = dict(resumed["losses"])
    assert sorted(resumed_losses) == [4, 5]
    assert resumed_losses[4] == pytest.approx(full_losses[4], rel=1e-5)
    assert resumed_losses[5] == pytest.approx(full_losses[5], rel=1e-4)


def test_torchtitan_style_script_runs_on_either_fsdp(tmp_path):
    """The FSDP2-API script, with only the import switched, trains as FSDP2 does (fp32 on
    CPU: same losses step by step) and resumes from its DCP checkpoint exactly."""
    script = example("torchtitan_style.py")
    runs = {}
    for impl, port in (("fsdp2", 29584), ("mfsdp", 29585)):
        run_script(2, script, "--impl", impl, "--steps", "6", "--out", str(tmp_path / impl), port=port, timeout=240)
        runs[impl] = json.loads((tmp_path / impl / f"losses_{impl}.json").read_text())
    ours, theirs = runs["mfsdp"], runs["fsdp2"]
    assert len(ours["losses"]) == len(theirs["losses"]) == 6
    for a, b in zip(ours["losses"], theirs["losses"]):
        assert abs(a - b) < 1e-5, (ours["losses"], theirs["losses"])
    assert ours["losses"][-1] < ours["losses"][0] - 0.05  # it learns
    for run in (ours, theirs):
        assert abs(run["resumed_eval_loss"] - run["original_eval_loss"]) < 1e-6, run


# The 12-step world-2 run of train_gpt.py with the defaults (no --tp, no --offload): the
# reference of the TP run and of the offloaded run below, trained once for both.
SHORT = ["--device", "cpu", "--steps", "12", "--seq-len", "32", "--micro-batch", "4", "--d-model", "64", "--layers",
         "2", "--heads", "4", "--corpus-mb", "1"]


@pytest.fixture(scope="module")
def plain_short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_gpt_plain")
    metrics_path = out / "metrics.json"
    run_script(2, example("train_gpt.py"), *SHORT, "--out-dir", str(out / "run"), "--metrics-json", str(metrics_path),
               port=29591, timeout=180)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world"] == 2 and metrics["tp"] == 1 and len(metrics["losses"]) == 12
    return metrics


def test_train_gpt_tensor_parallel_matches_the_1d_run(tmp_path, plain_short_run):
    """--tp 2 at world 4 (FSDP 2 x TP 2) sees the same rows per data-parallel rank as the
    1-D run at world 2: its loss curve is the same."""
    metrics_path = tmp_path / "metrics_tp2.json"
    run_script(4, example("train_gpt.py"), *SHORT, "--tp", "2", "--out-dir", str(tmp_path / "tp2"),
               "--metrics-json", str(metrics_path), port=29587, timeout=180)
    runs = {1: plain_short_run, 2: json.loads(metrics_path.read_text())}
    assert runs[2]["tp"] == 2 and runs[2]["world"] == 4
    one, two = runs[1]["losses"], runs[2]["losses"]
    assert len(one) == len(two) == 12
    for step, (a, b) in enumerate(zip(one, two)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: loss {b} with TP 2 vs {a} without"
    assert abs(runs[1]["held_out_loss"] - runs[2]["held_out_loss"]) <= 1e-4 * runs[1]["held_out_loss"]


def test_train_gpt_offloaded_matches_the_device_run(tmp_path, plain_short_run):
    """--offload (shards, gradients and AdamW state in host memory, CPUAdamW with its
    overlapped step) trains the example as the plain run does: the same losses within
    float rounding (CPUAdamW against torch's AdamW), and a checkpoint that loads."""
    metrics_path = tmp_path / "metrics--offload.json"
    run_script(2, example("train_gpt.py"), *SHORT, "--offload", "--out-dir", str(tmp_path / "--offload"),
               "--metrics-json", str(metrics_path), port=29593, timeout=180)
    runs = {"": plain_short_run, "--offload": json.loads(metrics_path.read_text())}
    plain, offloaded = runs[""]["losses"], runs["--offload"]["losses"]
    assert len(plain) == len(offloaded) == 12 and plain[-1] < plain[0]
    for step, (a, b) in enumerate(zip(plain, offloaded)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: loss {b} offloaded vs {a}"
    assert abs(runs[""]["held_out_loss"] - runs["--offload"]["held_out_loss"]) <= 1e-4 * runs[""]["held_out_loss"]
