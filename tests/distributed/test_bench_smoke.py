"""The benchmark scripts run end to end (CPU + Gloo, tiny config) and their JSON holds
what a committed run needs: per-iteration times of the slowest rank, medians that follow
from them, and the run's metadata. Timings themselves are measured on the GPU machine
(benchmarks/RESULTS.md, raw files in benchmarks/data/)."""
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from harness.launcher import run_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name):
    if not (BENCH / name).exists():
        pytest.skip("benchmarks/ is not part of this checkout")
    return BENCH / name


def check_meta(meta, script, world=2):
    assert meta["world"] == world and meta["torch"] and meta["date"] and meta["device_name"]
    assert script in meta["command"] and meta["command"].startswith(f"torchrun --nproc_per_node={world} ")
    assert "commit" in meta and "build" in meta


@pytest.fixture(scope="module")
def bench_train_run(tmp_path_factory):
    """bench_train.py's default systems (mfsdp, fsdp2, ddp) on the tiny config, built
    directly (no --meta-init): checked below, and the direct-build reference of the
    --meta-init run (its mfsdp row: the first system, as in a run of mfsdp alone)."""
    out = tmp_path_factory.mktemp("bench_train")
    run_script(2, _script("bench_train.py"), "--device", "cpu", "--configs", "tiny", "--steps", "2",
               "--warmup", "1", "--out", str(out), port=29571)
    return out, json.loads((out / "results.json").read_text())


def test_bench_train_tiny_cpu(bench_train_run):
    out, data = bench_train_run
    systems = {r["system"] for r in data["results"]}
    assert systems == {"mfsdp", "fsdp2", "ddp"}
    losses = {r["system"]: r["final_loss"] for r in data["results"]}
    # Same model, seed and data: the three systems train alike (fp32 on CPU).
    assert max(losses.values()) - min(losses.values()) < 1e-3, losses
    check_meta(data["meta"], "bench_train.py")
    for r in data["results"]:
        assert len(r["step_times_s"]) == 2 and min(r["step_times_s"]) > 0
        assert r["step_s"] == pytest.approx(statistics.median(r["step_times_s"]))
    assert "| tiny | mfsdp |" in (out / "results.md").read_text()


def test_bench_train_mixture_of_experts_with_expert_parallelism_cpu(tmp_path):
    """--experts 4 --ep 2 at world 4: ours and FSDP2, the experts on the expert data-parallel
    mesh and tokens exchanged by all-to-all, train like the whole MoE model run without
    expert parallelism on each rank's batch (local; every system's first loss is the same
    function of the same data), also with the fixed routing of --balanced-routing, and
    refusals name the problem."""
    run_script(4, _script("bench_train.py"), "--device", "cpu", "--configs", "tiny", "--steps", "2",
               "--warmup", "0", "--systems", "mfsdp,fsdp2,local", "--experts", "4", "--ep", "2",
               "--balanced-routing", "--out", str(tmp_path), port=29577)
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"mfsdp", "fsdp2", "local"}
    for system, r in rows.items():
        assert (r["experts"], r["ep"], r["balanced_routing"]) == (4, 2, True), r
        assert r["routing_kept_fraction"] == 1.0, r  # every (token, choice) pair kept
        assert (r["moe_form"] is None) == (system == "local"), r
    # The first timed step is the first update: rank 0's loss before any update is one
    # function of the same seeded model and rank 0's batch, whoever computes it.
    first = {s: r["losses"][0] for s, r in rows.items()}
    assert max(first.values()) - min(first.values()) < 1e-5, first
    assert abs(rows["mfsdp"]["losses"][1] - rows["fsdp2"]["losses"][1]) < 1e-4, (rows["mfsdp"]["losses"],
                                                                               rows["fsdp2"]["losses"])
    bad = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29578",
                          f"--log-dir={tmp_path / 'torchrun_logs'}", str(_script("bench_train.py")),
                          "--device", "cpu", "--configs", "tiny", "--systems", "ddp", "--experts", "4", "--ep", "2",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0 and "--ep 2: ddp does not place experts on their own mesh" in bad.stdout + bad.stderr


def test_bench_layerwise_tiny_cpu(tmp_path):
    run_script(2, _script("bench_layerwise.py"), "--device", "cpu", "--config", "tiny", "--steps", "2",
               "--warmup", "1", "--out", str(tmp_path), port=29572)
    data = json.loads((tmp_path / "layerwise.json").read_text())
    assert [r["system"] for r in data["results"]] == ["replicated", "layerwise_sync", "layerwise_overlap"]
    losses = [r["final_loss"] for r in data["results"]]
    # The same Muon + AdamW math, distributed three ways (fp32 on CPU).
    assert max(losses) - min(losses) < 1e-4, losses
    check_meta(data["meta"], "bench_layerwise.py")
    for r in data["results"]:
        steps, opt = r["step_times_s"], r["opt_phase_times_s"]
        assert len(steps) == len(opt) == 2
        assert all(0 < o < s for o, s in zip(opt, steps))  # the optimizer phase is part of the step
        assert r["step_s"] == pytest.approx(statistics.median(steps))
        assert r["opt_phase_s"] == pytest.approx(statistics.median(opt))


def test_bench_comm_tiny_cpu(tmp_path):
    run_script(2, _script("bench_comm.py"), "--device", "cpu", "--sizes-mib", "0.0625", "--uneven-mib", "0.0625",
               "--iters", "50", "--warmup", "1", "--out", str(tmp_path), port=29573, timeout=150)
    data = json.loads((tmp_path / "comm.json").read_text())
    check_meta(data["meta"], "bench_comm.py")
    assert data["meta"]["iters"] == 50
    raw = data["raw_ms"]
    assert set(raw) == {"0.0625MiB_ag", "0.0625MiB_rs", "0.0625MiB_ag_v_padded", "0.0625MiB_rs_v_padded",
                        "0.0625MiB_rs_v_all_reduce"}
    assert all(len(times) == 50 and min(times) > 0 for times in raw.values())
    (row,), (uneven,) = data["rows"], data["uneven"]
    for key, name in [(row, "ag"), (row, "rs"), (uneven, "ag_v_padded"), (uneven, "rs_v_padded"),
                      (uneven, "rs_v_all_reduce")]:
        times = raw[f"0.0625MiB_{name}"]
        assert key[f"{name}_ms"] == pytest.approx(statistics.median(times))
        spread = key[f"{name}_spread_ms"]
        assert spread["min"] == min(times) and spread["max"] == max(times)
        assert spread["min"] <= spread["p10"] <= key[f"{name}_ms"] <= spread["p90"] <= spread["max"]
    # Bus bandwidth as nccl-tests: 64 KiB of bf16, half of it crossing per rank at world 2.
    assert row["ag_busbw_gbs"] == pytest.approx(2**16 / 2 / (row["ag_ms"] / 1e3) / 1e9)


def _load_bench_comm():
    spec = importlib.util.spec_from_file_location("bench_comm", _script("bench_comm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _slowest_rank_decides(rank, world):
    bench_comm = _load_bench_comm()
    timer = bench_comm.Timer(torch.device("cpu"), iters=6, warmup=1)
    # Rank 1 takes 30 ms more per iteration: both ranks must report rank 1's times.
    median_s = timer("slow_rank", lambda: time.sleep(0.03 if rank == 1 else 0.0))
    return median_s, timer.raw_ms["slow_rank"], timer.spread("slow_rank")


def test_bench_comm_reports_the_slowest_rank():
    _script("bench_comm.py")
    results = run_distributed(_slowest_rank_decides, 2, timeout=120)
    (median0, raw0, spread0), (median1, raw1, spread1) = results
    assert raw0 == raw1 and median0 == median1 and spread0 == spread1
    assert len(raw0) == 6 and min(raw0) >= 30.0, raw0
    assert median0 == pytest.approx(statistics.median(raw0) / 1e3)


def test_bench_train_meta_init_tiny_cpu(tmp_path, bench_train_run):
    """--meta-init: both FSDP systems build on meta and initialize their shards. Ours starts
    from exactly the values of the direct build (same losses as a run without
    --meta-init); FSDP2's DTensor initializers draw per shard on CPU, so its values differ
    and only its loss range is checked. The JSON records init time and local shard size."""
    run_script(2, _script("bench_train.py"), "--device", "cpu", "--configs", "tiny", "--steps", "2",
               "--warmup", "1", "--systems", "mfsdp,fsdp2", "--meta-init", "--out", str(tmp_path), port=29574)
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"mfsdp", "fsdp2"} and all(r["meta_init"] for r in rows.values())
    full_bytes = 4 * sum(p.numel() for p in _tiny_model().parameters())
    for r in rows.values():
        assert r["init_s"] > 0
        assert r["local_shards_gib"] * 2**30 <= full_bytes / 2 + 4096, (r["local_shards_gib"], full_bytes)
    assert abs(rows["mfsdp"]["final_loss"] - rows["fsdp2"]["final_loss"]) < 0.2, rows
    # The direct build: bench_train_run's mfsdp row (same config, steps and seeds).
    direct = bench_train_run[1]["results"][0]
    assert direct["system"] == "mfsdp" and not direct["meta_init"]
    assert direct["final_loss"] == pytest.approx(rows["mfsdp"]["final_loss"], rel=1e-6, abs=1e-6)


def _tiny_model():
    import importlib.util as iu
    spec = iu.spec_from_file_location("bench_train_cfg", _script("bench_train.py"))
    # Read CONFIGS without running the script's main().
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
    vocab, d, layers, heads, ffn, _, seq = mod.CONFIGS["tiny"]
    with torch.device("meta"):
        return LlamaModel(LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn,
                                      max_seq_len=seq))


def test_compare_systems_runs_each_system_alone_interleaved(tmp_path):
    """compare_systems.py: one process per (round, config, system), the order rotated every
    round, a failing system recorded with its error while the others go on, and a summary
    whose medians and ratios follow from the rows."""
    import subprocess
    import sys

    out = tmp_path / "cmp"
    proc = subprocess.run(
        [sys.executable, str(_script("compare_systems.py")), "--nproc", "2", "--rounds", "2", "--configs", "tiny",
         "--systems", "local,no_such_system", "--steps", "2", "--warmup", "1", "--device", "cpu",
         "--out", str(out), "--port", "29577", "--timeout", "240"],
        capture_output=True, text=True, timeout=900, env=dict(__import__("os").environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "rows.json").read_text())
    assert [(r["round"], r["system"]) for r in rows] == [
        (0, "local"), (0, "no_such_system"), (1, "no_such_system"), (1, "local")]
    data = json.loads((out / "summary.json").read_text())
    summary = data["summary"]
    bad = summary["tiny/no_such_system"]
    assert bad["ok_rounds"] == 0 and "unknown system" in " ".join(bad["errors"])
    limit = summary["tiny/local"]
    medians = [r["step_s"] * 1e3 for r in rows if r["system"] == "local"]
    assert limit["ok_rounds"] == 2 and limit["step_ms"] == pytest.approx(statistics.median(medians))
    assert limit["step_ms_min"] == min(medians) and limit["vs_local"] == 1.0 and "vs_fsdp2" not in limit
    assert "compare_systems.py" in data["meta"]["command"] and data["meta"]["rounds"] == 2
    assert "| tiny | no_such_system | failed:" in (out / "summary.md").read_text()
    assert (out / "step_time.png").stat().st_size > 0


def test_bench_unit_overhead_tiny_cpu(tmp_path):
    """bench_unit_overhead.py reports, per variant, every hook phase from the profiler
    scopes and the unprofiled hook clock, with one call per unit per step where the
    schedule says so, and buckets cutting the collectives to one per bucket."""
    run_script(1, _script("bench_unit_overhead.py"), "--device", "cpu", "--units", "4", "--steps", "2",
               "--warmup", "1", "--profile-steps", "2", "--bucket-units", "2",
               "--op-table", "200", "--out", str(tmp_path), port=29578)
    data = json.loads((tmp_path / "overhead.json").read_text())
    result = data["result"]
    assert result["units"] == 5 and result["plain_step_ms"] > 0 and result["bucket_units"] == 2
    assert set(result["variants"]) == {"per_unit", "bucketed"}
    assert data["meta"]["profile_steps"] == 2
    parts = ["forward", "backward", "optimizer", "drain"]
    assert list(result["plain_step_parts_ms"]) == parts and result["plain_gc_ms_per_step"] >= 0
    assert len(result["plain_step_times_s"]) == 2
    for name, variant in result["variants"].items():
        assert variant["step_ms"] > 0 and variant["gc_ms_per_step"] >= 0 and len(variant["step_times_s"]) == 2
        # The parts are medians of each part, so they need not add up to the median step.
        assert list(variant["step_parts_ms"]) == parts
        assert sum(variant["step_parts_ms"].values()) == pytest.approx(variant["step_ms"], rel=0.5)
        phases = variant["phases"]
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "reshard"):
            assert phases[phase]["us_per_unit_per_step"] > 0, (name, phase)
        assert phases["pre_forward"]["calls_per_step"] == 5 and phases["pre_backward"]["calls_per_step"] == 5
        # The clock counts outermost hook calls only: one per unit per step (the root's
        # post-backward runs in the final callback, which is clocked once a step).
        clock = variant["hook_clock"]
        assert {k: v["calls_per_step"] for k, v in clock.items()} == {
            "pre_forward": 5, "post_forward": 5, "pre_backward": 5, "post_backward": 4, "final_callback": 1}
        assert variant["hook_clock_us_per_unit"] == pytest.approx(
            sum(v["us_per_unit_per_step"] for v in clock.values()))
        assert all(v["us_per_unit_per_step"] > 0 for v in clock.values())
        # The operator table: sorted by added self time, one row per hook phase (not per
        # unit), each hook's calls counted once per unit per step.
        ops = variant["ops"]
        added = [r["added_self_us_per_unit"] for r in ops]
        assert added == sorted(added, reverse=True)
        hooks = {r["op"].split(" ")[0]: r for r in ops if r["op"].startswith("mfsdp::")}
        assert hooks["mfsdp::pre_forward"]["added_calls_per_unit"] == pytest.approx(1.0)
        assert hooks["mfsdp::pre_backward"]["added_calls_per_unit"] == pytest.approx(1.0)
        assert not any("[" in r["op"] for r in ops if r["op"].startswith("mfsdp::"))
    # Per unit: an all-gather per unit in forward and in backward (the root stays gathered)
    # and a reduce-scatter per unit. Buckets of 2 (in forward order: root+b0, b1+b2, b3),
    # prefetching one bucket ahead, each unshard call gathering all its targets in one
    # collective: forward root+b0+b1+b2 then b3, backward b3+b2+b1 then b0; and 3 reductions.
    per_unit, bucketed = result["variants"]["per_unit"]["phases"], result["variants"]["bucketed"]["phases"]
    assert per_unit["all_gather"]["calls_per_step"] == 9 and per_unit["reduce_scatter"]["calls_per_step"] == 5
    assert bucketed["all_gather"]["calls_per_step"] == 4 and bucketed["reduce_scatter"]["calls_per_step"] == 3
    assert bucketed["unshard"]["calls_per_step"] == 9


def test_spy_steps_runs_and_summarizes_per_thread(tmp_path):
    """spy_steps.py's `run` trains a few steps on CPU; `summarize` merges py-spy's two
    spellings of one thread, counts the stepping thread's samples only inside _step, the
    other threads' whole, and a stack with no Python frame as such."""
    script = _script("spy_steps.py")
    # The environment as it is: the package imports as the tests import it (installed, or
    # src/ on PYTHONPATH).
    done = subprocess.run([sys.executable, str(script), "run", "--variant", "bucketed", "--steps", "2", "--units", "4",
                           "--bucket-units", "2"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bucketed:" in done.stdout and "forward" in done.stdout
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        "thread (7): MainThread;<module> (a.py:1);import_it (a.py:2) 50",
        "thread (7);<module> (a.py:1);_step (b.py:3);hook (c.py:4) 30",
        "thread (7): MainThread;<module> (a.py:1);_step (b.py:3) 10",
        "thread (9);post (c.py:9) 15",
        "thread (9) 45",
    ]) + "\n")
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(script), "summarize", str(raw), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert set(summary) == {"thread (7)", "thread (9)"}
    main, engine = summary["thread (7)"], summary["thread (9)"]
    assert main["samples"] == 40 and "import_it" not in main["inclusive_pct"]
    assert main["inclusive_pct"]["_step"] == 100.0 and main["inclusive_pct"]["hook"] == 75.0
    assert main["self_pct"] == {"hook": 75.0, "_step": 25.0}
    assert engine["samples"] == 60 and engine["self_pct"] == {"(no Python frame)": 75.0, "post": 25.0}


def test_simulate_tiny_cpu(tmp_path):
    """The one-GPU sizing simulator (fake backend, one process per system, several worlds
    per process): our own collective counters agree with the process group's calls the
    profiler saw, FSDP2 issues as many all-gathers and reduce-scatters per step, and every
    point reports its step split and memory fields."""
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@4,32", "--systems",
                           "mfsdp,fsdp2", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "simulate.json").read_text())
    assert "command" in data["meta"] and "date" in data["meta"]
    rows = data["rows"]
    assert [(r["system"], r["world"]) for r in rows] == [("mfsdp", 4), ("mfsdp", 32), ("fsdp2", 4), ("fsdp2", 32)]
    units = 1 + 2  # the root and two blocks of "tiny"
    for r in rows:
        assert "error" not in r, r
        assert len(r["steps"]) == 2 and r["step_ms"] > 0 and r["forward_ms"] > 0 and r["backward_ms"] > 0
        calls = {k: v[0] for k, v in r["c10d_calls_per_step"].items()}
        # Ours agrees on which parameters got gradients before each reduction: one small
        # all-reduce per reduce-scatter (Unit::agree_on_grads).
        masks = {"c10d::allreduce_": units} if r["system"] == "mfsdp" else {}
        assert calls == {"c10d::_allgather_base_": 2 * units - 1, "c10d::_reduce_scatter_base_": units, **masks}, r
    for r in rows[:2]:
        ours = r["our_counts_per_step"]
        assert ours["all_gather"] == r["c10d_calls_per_step"]["c10d::_allgather_base_"], r
        assert ours["reduce_scatter"] == r["c10d_calls_per_step"]["c10d::_reduce_scatter_base_"], r
        # The profiler records no shapes for a tensor list (all_reduce's argument): calls only.
        assert ours["all_reduce"][0] == r["c10d_calls_per_step"]["c10d::allreduce_"][0], r
        assert r["estimate_gib"] > 0


@pytest.fixture(scope="module")
def simulate_indivisible_experts(tmp_path_factory):
    """simulate.py's output for --experts 6 --ep 4: one run (a fresh interpreter, ~3.5 s on
    2 cores) for every parametrization below, which ran this same command each."""
    proc = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@8", "--systems", "mfsdp",
                           "--experts", "6", "--ep", "4", "--out", str(tmp_path_factory.mktemp("sim_bad") / "bad")],
                          capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("form,experts,ep", [("shard_placement_fn", 8, 4), ("experts_unit", 8, 4),
                                             ("shard_placement_fn", 4, 2)])
def test_simulate_mixture_of_experts_with_expert_parallelism(tmp_path, form, experts, ep,
                                                            simulate_indivisible_experts):
    """simulate.py --experts 8 --ep 4 at world 8 (efsdp 2 x ep 4): both systems shard the
    experts over the expert data-parallel mesh and the rest over the world, so each issues
    one all-gather and one reduce-scatter per mesh per unit (the root, and the two blocks
    twice: dense and experts), four all-to-alls per block forward and backward, and the
    same bytes give or take padding; estimate_memory counts the expert units. With 4
    experts over ep 2 (efsdp 4 > 2 local experts) FSDP2's experts shard dim 1 as
    torchtitan does it: on dim 0 it would pad 2 rows up to 4 and move twice the bytes."""
    if form == "shard_placement_fn":
        pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common").ShardPlacementResult
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@8", "--systems",
                           "mfsdp,fsdp2", "--experts", str(experts), "--ep", str(ep), "--moe-form", form, "--steps", "2",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "simulate.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["mfsdp", "fsdp2"]
    units = 1 + 2 * 2
    calls = []
    for r in rows:
        assert "error" not in r and r["moe_form"] == form and (r["experts"], r["ep"]) == (experts, ep), r
        assert r["routing_kept_fraction"] == 1.0, r  # the same balanced routing in every system
        got = r["c10d_calls_per_step"]
        masks = {"c10d::allreduce_": units} if r["system"] == "mfsdp" else {}  # one per reduction
        assert {k: v[0] for k, v in got.items()} == {
            "c10d::_allgather_base_": 2 * units - 1, "c10d::_reduce_scatter_base_": units,
            "c10d::alltoall_base_": 2 * 2 * 2, **masks}, r
        calls.append(got)
    for kind in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
        ours, theirs = calls[0][kind][1], calls[1][kind][1]
        assert abs(ours - theirs) <= 0.01 * theirs, (kind, ours, theirs)
    assert rows[0]["estimate_gib"] > 0
    assert "--ep 4: needs --experts divisible by it" in simulate_indivisible_experts


def test_simulate_experts_without_expert_parallelism_shard_as_torchtitan(tmp_path):
    """simulate.py --experts 4 at world 8, no --ep: the experts shard with the block, on
    dim 1 where the world exceeds the experts (torchtitan's ep_degree == 1 rule), so both
    systems gather the same bytes. On dim 0 FSDP2 would pad 4 experts up to 8 rows and move
    about twice the expert bytes (an unfair peer, and a 2.7x larger peak at W 256)."""
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@8", "--systems",
                           "mfsdp,fsdp2", "--experts", "4", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "simulate.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["mfsdp", "fsdp2"]
    units = 1 + 2
    for r in rows:
        assert "error" not in r and (r["experts"], r["ep"]) == (4, 1) and r["routing_kept_fraction"] == 1.0, r
        masks = {"c10d::allreduce_": units} if r["system"] == "mfsdp" else {}  # one per reduction
        assert {k: v[0] for k, v in r["c10d_calls_per_step"].items()} == {
            "c10d::_allgather_base_": 2 * units - 1, "c10d::_reduce_scatter_base_": units, **masks}, r
    for kind in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
        ours, theirs = rows[0]["c10d_calls_per_step"][kind][1], rows[1]["c10d_calls_per_step"][kind][1]
        assert abs(ours - theirs) <= 0.01 * theirs, (kind, ours, theirs)


def test_simulate_plans_auto_buckets_from_a_given_link(tmp_path):
    """simulate.py --link: ours plans its "auto" buckets from the given link (under the fake
    backend nothing moves, so without it no buckets), records the link and the budgets,
    and issues the bucketed collectives: 100 us at 1 GB/s gives 1 MiB, more than all of
    tiny's units together, so one all-gather each way and one reduce-scatter."""
    out = tmp_path / "sim"
    proc = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@8", "--systems", "mfsdp",
                           "--steps", "2", "--warmup", "1", "--link", "100:1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((out / "simulate.json").read_text())["rows"]
    assert "error" not in row, row
    assert row["bucket_budgets"] == [1 << 20, 1 << 20], row
    assert row["link_model"] == {"alpha_s": pytest.approx(1e-4), "bytes_per_s": pytest.approx(1e9)}, row
    calls = {k: v[0] for k, v in row["c10d_calls_per_step"].items()}
    # A bucket of several units goes as one coalesced collective, its gradient agreement as one all-reduce.
    assert calls == {"c10d::allgather_into_tensor_coalesced_": 2, "c10d::reduce_scatter_tensor_coalesced_": 1,
                     "c10d::allreduce_": 1}, row
    bad = subprocess.run([sys.executable, str(_script("simulate.py")), "--points", "tiny@8", "--systems", "mfsdp",
                          "--link", "fast", "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--link 'fast': expected ALPHA_US:GBPS" in bad.stdout + bad.stderr


def test_bench_async_save_tiny_cpu(tmp_path):
    """bench_async_save.py, one run per system: every mode's times are the slowest rank's,
    summarized over the repeats; an asynchronous save blocks for less time than it takes
    in all; both systems save the same model."""
    runs = {}
    for port, system in ((29579, "mfsdp"), (29580, "fsdp2")):
        out = tmp_path / f"{system}.json"
        run_script(2, _script("bench_async_save.py"), "--system", system, "--device", "cpu", "--model", "tiny",
                   "--repeats", "2", "--dir", str(tmp_path), "--out", str(out), port=port)
        runs[system] = data = json.loads(out.read_text())
        check_meta(data["meta"], "bench_async_save.py")
        assert data["system"] == system and data["world"] == 2 and data["checkpoint_bytes"] > 0 and data["staging"]
        results = data["results"]
        assert set(results) == {"sync", "async", "load"}
        for times in (results["sync"]["blocked_s"], results["async"]["blocked_s"], results["async"]["total_s"],
                      results["load"]["seconds"]):
            assert len(times["all"]) == 2 and min(times["all"]) > 0
            assert times["median"] == pytest.approx(statistics.median(times["all"]))
            assert times["min"] == min(times["all"]) and times["max"] == max(times["all"])
        assert all(b < t for b, t in zip(results["async"]["blocked_s"]["all"], results["async"]["total_s"]["all"]))
    assert runs["mfsdp"]["params"] == runs["fsdp2"]["params"] == sum(p.numel() for p in _tiny_model().parameters())
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [], "a run left checkpoints behind"
