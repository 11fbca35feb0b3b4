"""Mixture-of-experts units (experts on the expert data-parallel mesh through FSDP2's
ShardPlacementResult, torchtitan 0.3.0's form) with ZeRO-2, CPU offload and torch.compile
of the blocks, against FSDP2 under the same script (tests/harness/moe_feature_workers.py).

One Gloo launch at world 4, ep 2 (dense parameters over the 4-rank "fsdp" mesh, experts
over the 2-rank "efsdp" mesh), 3 SGD steps per config, FSDP2 then ours:
- zero2: reshard_after_forward=False on the blocks, expert weights DTensors Shard(0) on
  "ep", FSDP2's default gradient division (each mesh by its own size);
- compile: block.compile(fullgraph=True, backend=aot_eager) after fully_shard, DTensor
  experts, torchtitan's division (none);
- offload: offload_policy=CPUOffloadPolicy(pin_memory=False) on blocks and root, the experts
  plain per-ep-rank parameters (Megatron-Core's form), with and without the default
  division, and DTensors Shard(0) on "ep" (torchtitan's form);
- buckets: ours with one gather and one reduce bucket budget for every unit (the root's
  gather_bucket_bytes / reduce_bucket_bytes), FSDP2 as it is (it has no buckets);
- zero1, no_shard: ours only (FSDP2 has neither), against one plain process.
Per step the loss and the global gradient norm, and the full gradients of the expert and
the dense parameters (SGD: (before - after) / lr), then the values after the last step,
within 1e-5 relative (fp32; measured <= 2.5e-6); the state-dict placements equal. zero2 and
compile are also checked against one plain process holding every expert
(moe_unit_workers.one_process). Each config also shows its option on both systems' dense
and expert units of every block."""
import pytest

from harness import moe_feature_workers as w
from harness import run_distributed

WORLD, EP, STEPS = 4, 2, 3
TOL = 1e-5  # relative, fp32: loss, norm, every step's full gradients, final values

CONFIGS = [
    dict(name="zero2", feature="zero2", form="dtensor", ep=EP, factor=None, one_process=True),
    dict(name="compile", feature="compile", form="dtensor", ep=EP, factor=1.0, one_process=True),
    dict(name="offload", feature="offload", form="plain", ep=EP, factor=1.0),
    dict(name="offload_default_division", feature="offload", form="plain", ep=EP, factor=None),
    dict(name="offload_ep_dtensors", feature="offload", form="dtensor", ep=EP, factor=None),
    dict(name="buckets", feature="buckets", form="dtensor", ep=EP, factor=None, one_process=True),
    # FSDP2 has no ZeRO-1 or no-shard strategy: one plain process is the reference.
    dict(name="zero1", feature="zero1", form="dtensor", ep=EP, factor=None, one_process=True, fsdp2=False),
    dict(name="no_shard", feature="no_shard", form="dtensor", ep=EP, factor=1.0, one_process=True, fsdp2=False),
]


@pytest.fixture(scope="module")
def results():
    return run_distributed(w.moe_feature_vs_fsdp2, WORLD, CONFIGS, steps=STEPS, timeout=400)[0]


def _check_training(out, name):
    for ref in ("worst", "worst_one_process"):
        if ref not in out:
            continue
        bad = {k: v for k, v in out[ref].items() if not v <= TOL}
        assert not bad, f"{name}: ours vs {'FSDP2' if ref == 'worst' else 'one process'}: {bad} (all: {out[ref]})"
    assert "worst" in out or "worst_one_process" in out, f"{name}: compared with nothing"
    assert out["moved"] > 0.1, f"{name}: parameters moved by {out['moved']:.2e} only"
    if "worst" in out:
        assert out["placements_equal"], f"{name}: state-dict placements differ from FSDP2's"


def _every_unit(rows, want):
    """Each row (a block, or a step's blocks) says `want` for its dense and its expert unit."""
    flat = [r for row in rows for r in (row if isinstance(row, list) else [row])]
    return len(flat) > 0 and all(set(r) == {"dense", "experts"} and all(v is want for v in r.values()) for r in flat)


def test_moe_zero2_trains_like_fsdp2(results):
    """ZeRO-2: after every forward the dense and the expert unit of each block stay gathered
    (ours and FSDP2's param groups), each unit holds reshard_after_forward=False, and the
    training equals FSDP2's (and one process's)."""
    out = results["zero2"]
    _check_training(out, "zero2")
    for impl in ("fsdp2", "ours"):
        assert _every_unit(out["option"][impl], False), f"{impl}: reshards after forward {out['option'][impl]}"
        assert _every_unit(out["unsharded"][impl], True), f"{impl}: units after forward {out['unsharded'][impl]}"


def test_moe_compile_trains_like_fsdp2(results):
    """torch.compile of the blocks (fullgraph, aot_eager): one graph per block holding the
    dense Linear and both expert bmm's, run at every step's forward, under both systems;
    the blocks (ZeRO-3 here) resharded after forward, their dense and expert units alike
    (the control of the zero2 check); the training equals FSDP2's (and one process's)."""
    out = results["compile"]
    _check_training(out, "compile")
    for impl in ("fsdp2", "ours"):
        graphs, calls = out["graphs"][impl]
        assert len(graphs) == 2, f"{impl}: {len(graphs)} graphs, not one per block (a graph break or a recompile)"
        for ops in graphs:
            assert any("linear" in op for op in ops) and sum("bmm" in op for op in ops) == 2, f"{impl}: {ops}"
        assert calls == [STEPS, STEPS], f"{impl}: compiled graphs ran {calls} times, not once per step"
        assert _every_unit(out["unsharded"][impl], False), f"{impl}: units after forward {out['unsharded'][impl]}"
        assert _every_unit(out["option"][impl], True), f"{impl}: reshards after forward {out['option'][impl]}"


@pytest.mark.parametrize("name", ["offload", "offload_default_division", "offload_ep_dtensors"])
def test_moe_cpu_offload_trains_like_fsdp2(results, name):
    """CPU offload: every block's dense and expert unit offloaded (ours: unit.offloaded
    with its shards on the host; FSDP2: CPUOffloadPolicy on both param groups), and the
    training equals FSDP2's."""
    out = results[name]
    _check_training(out, name)
    for impl in ("fsdp2", "ours"):
        assert _every_unit(out["option"][impl], True), f"{impl}: offloaded units {out['option'][impl]}"


def test_moe_buckets_train_like_fsdp2(results):
    """Gather and reduce buckets on the root of a model whose blocks each hold a dense
    unit and an expert unit (two process groups): the training equals FSDP2's and one
    process's, the root holds the budgets, and a step issues fewer all-gather and
    reduce-scatter calls than FSDP2's one per param group (a bucket's units share one
    coalesced collective per process group; units of different groups never share)."""
    out = results["buckets"]
    _check_training(out, "buckets")
    assert out["budgets"] == (w.ONE_BUCKET, w.ONE_BUCKET), out["budgets"]
    ours, theirs = out["collectives"]["ours"], out["collectives"]["fsdp2"]
    for kind in ("gather", "scatter"):
        mine = sum(n for k, n in ours.items() if kind in k)
        fsdp2 = sum(n for k, n in theirs.items() if kind in k)
        assert 0 < mine < fsdp2, f"{kind} calls per step: ours {ours}, FSDP2 {theirs}"


@pytest.mark.parametrize("name", ["zero1", "no_shard"])
def test_moe_zero1_and_no_shard_train_like_one_process(results, name):
    """ZeRO-1 ("optim") and no shard on the blocks and the root, with the experts on the
    expert mesh: each block's dense and expert unit holds the strategy (whole gradients on
    every rank), no reduce-scatter runs, and the training equals one plain process's
    holding every expert."""
    out = results[name]
    _check_training(out, name)
    assert _every_unit(out["option"]["ours"], True), f"strategy on units {out['option']['ours']}"
    scatters = {k: n for k, n in out["collectives"]["ours"].items() if "scatter" in k and n}
    assert not scatters, f"{name} reduce-scattered: {scatters}"
