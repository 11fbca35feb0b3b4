"""Lightning's ModelParallelStrategy with the features of the README's matrix, the user's
code Lightning's own (tests/harness/lightning_feature_workers.py): Fabric with a
parallelize function that calls fully_shard with the option (ours; torch's FSDP2
fully_shard as the reference, under the same Fabric code), and the Trainer
(accumulate_grad_batches, gradient_clip_algorithm) with configure_model.

Fabric, one Gloo launch at world 2 (and one at world 4 for HSDP), 3 SGD steps per config,
FSDP2 then ours, then one plain process on the ranks' batches together:
- zero2: reshard_after_forward=False on the blocks and the root;
- zero1 / no_shard: ours' sharding_strategy="optim" / "no_shard" (FSDP2 has no ZeRO-1:
  the plain process is the reference; FSDP2's no-shard is HSDP on a (world, 1) mesh);
- hsdp (world 4): a (replicate 2, shard 2) mesh the user builds in the parallelize
  function (Lightning's own mesh is ("data_parallel", "tensor_parallel"));
- offload: offload_policy=CPUOffloadPolicy(pin_memory=False) on every unit;
- compile: each block compiled in place after fully_shard (fullgraph, aot_eager);
- buckets: gather_bucket_bytes / reduce_bucket_bytes on the root, small enough that some
  units share a bucket and not all (against ZeRO-3 with both 0);
- accumulation: 2 micro-batches per step, the first under fabric.no_backward_sync;
- clip: fabric.clip_gradients by norm (several configs) and by value;
- precision "bf16-mixed" (CPU autocast) and "bf16-true" against FSDP2 only (see below).
Per step the loss, the clip norm, the full gradient the optimizer applies (after the
clip) and the full values after the step, within 1e-5 relative (fp32; ||a - b|| / ||b||);
each config also shows, from ours' and FSDP2's own state, that the option reached every unit.

Trainer (world 2): fit with accumulate_grad_batches=2 and gradient_clip_algorithm "norm"
and "value" (clipping acting), ours and FSDP2 in configure_model against each other and a
plain process on the DistributedSampler's global micro-batches: each micro-batch's loss,
each step's clipped gradient and the values after it, within 1e-5."""
import pytest

from harness import lightning_feature_workers as w
from harness import run_distributed

STEPS = 3
TOL = 1e-5  # relative, fp32
CLIP_NORM = ("norm", 0.3)  # below every step's gradient norm (0.9-1.2): the clip acts
CLIP_VALUE = ("value", 0.02)

CONFIGS = [
    dict(name="zero3", feature="zero3", clip=CLIP_NORM),  # buckets 0: the control of "buckets"
    dict(name="zero2", feature="zero2"),
    dict(name="zero1", feature="zero1", fsdp2=False, clip=CLIP_NORM),
    dict(name="no_shard", feature="no_shard", clip=CLIP_NORM),
    dict(name="offload", feature="offload", clip=CLIP_NORM),
    dict(name="compile", feature="compile"),
    dict(name="buckets", feature="buckets"),
    dict(name="accumulate", feature="zero3", accum=2, clip=CLIP_NORM),
    dict(name="accumulate_zero1", feature="zero1", fsdp2=False, accum=2),
    dict(name="clip_value", feature="zero3", clip=CLIP_VALUE),
    dict(name="bf16_mixed", feature="zero3", precision="bf16-mixed", plain=False, clip=CLIP_NORM),
    dict(name="bf16_true", feature="zero3", precision="bf16-true", plain=False),
    dict(name="bf16_true_clip", feature="zero3", precision="bf16-true", plain=False, clip=CLIP_NORM),
]


@pytest.fixture(scope="module")
def results():
    return run_distributed(w.fabric_features, 2, CONFIGS, steps=STEPS, timeout=600)[0]


def _check_training(out, name, tol=TOL):
    refs = {"FSDP2": out.get("vs_fsdp2"), **{f"one process ({impl})": v for impl, v in out.get("vs_plain", {}).items()}}
    assert any(refs.values()), f"{name}: no reference ran"
    for ref, worst in refs.items():
        if worst is None:
            continue
        bad = {k: v for k, v in worst.items() if not v <= tol}
        assert not bad, f"{name}: ours vs {ref}: {bad} (all: {worst})"
    assert out["ours"]["moved"] > 0.05, f"{name}: parameters moved by {out['ours']['moved']:.2e} only"


def _option_everywhere(out, name, systems=("fsdp2", "ours")):
    for impl in systems:
        if impl in out:
            assert out[impl]["option"] == [True] * 3, f"{name}: {impl}'s units {out[impl]['option']}"


def _clipped(out, name):
    norms = out["plain_norms"] if "plain_norms" in out else out["fsdp2"]["norms"]
    assert len(norms) == STEPS and min(norms) > CLIP_NORM[1], f"{name}: the norm clip did not act: {norms}"


@pytest.mark.parametrize("name", ["zero3", "offload", "no_shard", "zero1"])
def test_lightning_fabric_strategy_trains_like_fsdp2_and_one_process(results, name):
    """ZeRO-3, CPU offload, no shard and ZeRO-1 (ours only) with fabric.clip_gradients by
    norm: every unit holds the option (offloaded shards on the host; the strategy; FSDP2's
    param groups offloaded or on its (replicate, shard) mesh), and ours trains as FSDP2
    and one process."""
    out = results[name]
    _check_training(out, name)
    _option_everywhere(out, name)
    _clipped(out, name)


def test_lightning_fabric_zero2_keeps_blocks_gathered_and_trains_alike(results):
    """ZeRO-2: after every forward both blocks stay gathered (ours and FSDP2's param
    groups; the zero3 config, the control, has them resharded), every unit holds
    reshard_after_forward=False, and the training equals FSDP2's and one process's."""
    out = results["zero2"]
    _check_training(out, "zero2")
    _option_everywhere(out, "zero2")
    for impl in ("fsdp2", "ours"):
        assert out[impl]["unsharded"] == [[True, True]] * STEPS, (impl, out[impl]["unsharded"])
        assert results["zero3"][impl]["unsharded"] == [[False, False]] * STEPS, (impl, results["zero3"][impl])


def test_lightning_fabric_compiled_blocks_train_alike(results):
    """Each block compiled in place in the parallelize function after fully_shard: one
    fullgraph graph holding the block's layer_norm, both linears and gelu, run by both
    blocks at every step's forward (2 x 3 calls), under both systems."""
    out = results["compile"]
    _check_training(out, "compile")
    for impl in ("fsdp2", "ours"):
        graphs, calls = out[impl]["graphs"]
        assert len(graphs) == 1, f"{impl}: {len(graphs)} graphs (a graph break or a recompile): {graphs}"
        assert sum("linear" in op for op in graphs[0]) == 2 and any("gelu" in op for op in graphs[0]), graphs
        assert calls == [2 * STEPS], f"{impl}: compiled graph ran {calls} times"


def test_lightning_fabric_buckets_reach_the_root_and_train_alike(results):
    """gather_bucket_bytes / reduce_bucket_bytes in the parallelize function: the root's
    bucket_budgets() are the values given, a step issues fewer all-gathers and fewer
    reduce-scatters than the same run with both 0 (units share buckets), and the
    training equals FSDP2's (which has no buckets) and one process's."""
    out, control = results["buckets"], results["zero3"]
    _check_training(out, "buckets")
    assert tuple(out["ours"]["budgets"]) == (w.BUCKET, w.BUCKET), out["ours"]["budgets"]
    assert tuple(control["ours"]["budgets"]) == (0, 0), control["ours"]["budgets"]
    for step in range(1, STEPS):
        got, per_unit = out["ours"]["counts"][step], control["ours"]["counts"][step]
        for op in ("all_gather", "reduce_scatter"):
            assert 0 < got[op] < per_unit[op], (step, op, got, per_unit)


@pytest.mark.parametrize("name", ["accumulate", "accumulate_zero1"])
def test_lightning_fabric_no_backward_sync_accumulates_like_one_process(results, name):
    """Two micro-batches per step, the first under fabric.no_backward_sync(model): the
    step's gradient is the mean of both (ZeRO-3 with the norm clip; ZeRO-1), as FSDP2's
    and one process's; Lightning's context reached ours: a step's two backwards issue the
    gradient reductions of one (those of the same run without accumulation)."""
    out = results[name]
    _check_training(out, name)
    control = results["zero1" if name.endswith("zero1") else "zero3"]["ours"]["counts"]
    for step, (got, once) in enumerate(zip(out["ours"]["counts"], control)):
        for op in ("reduce_scatter", "all_reduce"):
            assert got[op] == once[op], (step, op, got, once)
        assert got["reduce_scatter"] + got["all_reduce"] > 0, got
    if name == "accumulate":
        _clipped(out, name)


def test_lightning_fabric_clip_by_value_trains_alike(results):
    """fabric.clip_gradients(clip_val=): the clipped gradients FSDP2's and one process's."""
    _check_training(results["clip_value"], "clip_value")


def test_lightning_fabric_bf16_mixed_trains_like_fsdp2(results):
    """precision="bf16-mixed" (CPU autocast, fp32 parameters and gradients): ours against
    FSDP2 under the same autocast. The matmuls run in bf16 alike; what may differ is the
    order of the fp32 gradient reductions, so the fp32 tolerance stands (measured 1.4e-6)."""
    out = results["bf16_mixed"]
    _check_training(out, "bf16_mixed")
    assert out["ours"]["dtypes"] == ["torch.float32"], out["ours"]["dtypes"]


def test_lightning_fabric_bf16_true_trains_like_fsdp2(results):
    """precision="bf16-true": Fabric casts the module to bf16 before the parallelize
    function; parameters, gradients and their reduction are bf16 in both systems. Without
    a clip ours trains as FSDP2 within the fp32 tolerance (measured: bit for bit). With
    fabric.clip_gradients by norm, the bf16 norms may differ by one bf16 ulp (the two
    systems sum the squares in different orders; ours' is the fp64 norm rounded to nearest
    at the first step, FSDP2's the next bf16 up), which moves the clipped gradients and
    values by up to w.BF16_TOL."""
    for name, tol in (("bf16_true", TOL), ("bf16_true_clip", w.BF16_TOL)):
        out = results[name]
        assert out["ours"]["dtypes"] == ["torch.bfloat16"] == out["fsdp2"]["dtypes"], out
        _check_training(out, name, tol=tol)
    ours, theirs = results["bf16_true_clip"]["ours"]["norms"], results["bf16_true_clip"]["fsdp2"]["norms"]
    assert len(ours) == STEPS and all(abs(a - b) <= w.BF16_ULP * b for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.fixture(scope="module")
def hsdp():
    return run_distributed(w.fabric_features, 4, [dict(name="hsdp", feature="hsdp", clip=CLIP_NORM)],
                           steps=STEPS, timeout=600)[0]["hsdp"]


def test_lightning_fabric_hsdp_trains_like_fsdp2_and_one_process(hsdp):
    """HSDP at world 4: the parallelize function builds a (replicate 2, shard 2) mesh over
    Lightning's ranks and shards on it; every unit's parameters sit on that mesh (ours'
    and FSDP2's), and ours trains as FSDP2 and one process with fabric.clip_gradients by
    norm acting: losses, the norm it returns, clipped gradients, values."""
    _check_training(hsdp, "hsdp")
    _option_everywhere(hsdp, "hsdp")
    _clipped(hsdp, "hsdp")


def test_lightning_trainer_accumulates_and_clips_like_fsdp2_and_one_process(tmp_path):
    """Trainer.fit, accumulate_grad_batches=2, gradient_clip_algorithm "norm" (0.3) and
    "value" (0.02), each acting at every step, ours and FSDP2 against each other and one
    process on the sampler's global micro-batches."""
    out = run_distributed(w.trainer_accumulate_and_clip, 2, str(tmp_path), {"norm": 0.3, "value": 0.02},
                          timeout=600)[0]
    for algorithm, res in out.items():
        assert res["sharded"], algorithm
        assert res["steps"] == 4 and res["micro"] == 8, res
        for ref, worst in {"FSDP2": res["vs_fsdp2"], **res["vs_plain"]}.items():
            bad = {k: v for k, v in worst.items() if not v <= TOL}
            assert not bad, f"{algorithm}: vs {ref}: {bad} (all: {worst})"
        assert res["moved"] > 0.05, res["moved"]
    assert min(out["norm"]["plain_clip_norms"]) > 0.3, out["norm"]["plain_clip_norms"]
    assert out["value"]["plain_clipped"] > 0, out["value"]
