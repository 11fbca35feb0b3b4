"""Hugging Face Accelerate's loop on its FSDP2 path (prepare, accumulate, backward,
clip_grad_norm_, optimizer and scheduler steps) under the options its
FullyShardedDataParallelPlugin and ParallelismConfig pass to fully_shard, with ours
patched in for torch's (torch.distributed.fsdp.fully_shard = megatron_fsdp_ext.fully_shard)
against FSDP2 under the same plugin in the same processes: every micro-batch's loss and
every step's clip norm on every rank, the full gradients before each clip and the
parameters after the last step; and where each option shows on our units.

- reshard_after_forward=False (Accelerate's SHARD_GRAD_OP, ZeRO-2), with ours as is and
  with ours patched in as functools.partial(fully_shard, sharding_strategy="optim_grads");
- cpu_offload=True (CPUOffloadPolicy(); FSDP2 cannot pin without an accelerator, so its
  run takes CPUOffloadPolicy(pin_memory=False));
- ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): HSDP on a 2 x 2 mesh (world 4);
- the default plugin with ours patched in as partial(fully_shard, ...) with explicit
  gather_bucket_bytes / reduce_bucket_bytes (two units share a bucket), with
  sharding_strategy="optim" (ZeRO-1) and "no_shard", each against FSDP2's default;
- Accelerator(dynamo_backend="AOT_EAGER"): Accelerate compiles the whole model before
  its fully_shard calls (its FSDP2 path), under FSDP2 as under ours;
- Accelerator(mixed_precision="bf16"): the plugin's MixedPrecisionPolicy (bf16 params,
  reductions and outputs) and Accelerate's autocast, against FSDP2 under the same: bf16
  tolerances (the losses agree to the bit here, the gradients to bf16 rounding);
- Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=
  Float8LinearConfig(enable_fsdp_float8_all_gather=True))]): Accelerate's own torchao FP8
  path (prepare converts the Linears to Float8Linear, registers torchao's scale
  precompute on the optimizer, shards), weights gathered in FP8, against FSDP2 + torchao's
  FP8 gather under the same (its own launch).
On the way: accelerator.gather / reduce of every micro-batch's loss, and
unwrap_model(model).save_pretrained(state_dict=accelerator.get_state_dict(model)) after
the loop (the saved tensors are the trained parameters, as FSDP2's).

On CPU Accelerate 1.12 takes the job for MULTI_CPU: it ignores the FSDP plugin and refuses
a ParallelismConfig (its _validate_accelerator wants FSDP2 or a GPU-like device), so the
workers make the job FSDP after construction and then give the ParallelismConfig as
Accelerator.__init__ would (tests/harness/accelerate_feature_workers.py). Tensor
parallelism cannot run here, under FSDP2 as under ours: Accelerate 1.12's prepare imports a
class transformers 5 removed.
Workers: tests/harness/accelerate_feature_workers.py."""
import pytest

from harness.accelerate_feature_workers import BUCKET_BYTES, MAX_NORM, REFUSED_DEFAULT_PLUGIN, SHARED_REFERENCE
from harness.launcher import run_distributed

pytest.importorskip("accelerate", reason="Accelerate's FSDP2 path needs accelerate (test extra)")
pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")

from test_accelerate_loop import assert_tree_close  # noqa: E402  (tests/distributed, pytest's rootdir path)

WORLD2 = ("no_reshard", "zero2", "offload", "buckets", "zero1", "no_shard", "compile", "bf16")


@pytest.fixture(scope="module")
def world2():
    from harness.accelerate_feature_workers import accelerate_features
    return run_distributed(accelerate_features, 2, WORLD2, timeout=300)


@pytest.fixture(scope="module")
def world4():
    from harness.accelerate_feature_workers import accelerate_features
    return run_distributed(accelerate_features, 4, ("hsdp",), timeout=300)


def _trains_like_fsdp2(per_rank, name, steps, reference=None, **tol):
    """Ours against FSDP2 under `name`'s plugin: losses and norms on every rank, full
    gradients at every step and the final parameters (rank 0). The clip acts at every step
    (norm above MAX_NORM), so a wrong gradient scale shows in the parameters too. Every
    rank's acc.gather of the losses is the ranks' losses, acc.reduce their mean."""
    world = len(per_rank)
    for rank, res in enumerate(per_rank):
        ours, theirs = res[(name, "ours")], res[(reference or name, "fsdp2")]
        assert len(ours["steps"]) == steps, (rank, len(ours["steps"]))
        assert_tree_close(ours["losses"], theirs["losses"], f"{name} rank {rank} losses", **tol)
        assert_tree_close(ours["steps"], theirs["steps"], f"{name} rank {rank} steps", **tol)
        if rank == 0:
            assert_tree_close(ours["params"], theirs["params"], f"{name} final parameters", **tol)
        if "gathered" in ours:
            every = [[per_rank[r][(name, "ours")]["losses"][i] for r in range(world)]
                     for i in range(len(ours["losses"]))]
            assert_tree_close(ours["gathered"], every, f"{name} rank {rank} acc.gather of the losses")
            assert_tree_close(ours["reduced"], [sum(x) / world for x in every], f"{name} rank {rank} acc.reduce",
                              **tol)
    assert all(s["norm"] > MAX_NORM for s in per_rank[0][(name, "ours")]["steps"])
    ours = per_rank[0][(name, "ours")]
    if "save_pretrained" in ours:  # the trained values, FSDP2's file's
        theirs = per_rank[0][(reference or name, "fsdp2")]["save_pretrained"]
        params = ours["params"]
        assert ours["save_pretrained"].keys() == params.keys(), sorted(ours["save_pretrained"])
        assert_tree_close(ours["save_pretrained"], params, f"{name} save_pretrained", rtol=0, atol=0)
        assert_tree_close(ours["save_pretrained"], theirs, f"{name} save_pretrained vs FSDP2's", **tol)


def _units(rec, phase, root=None):
    units = rec["probe"][phase]
    return [u for u in units if root is None or u["is_root"] == root]


def test_no_reshard_after_forward_trains_like_fsdp2(world2):
    """FullyShardedDataParallelPlugin(reshard_after_forward=False): every unit of ours has
    reshard_after_forward False and keeps its gathered parameters from forward to backward
    (the blocks' slots hold the unsharded parameters after a forward; released by the
    backward: ZeRO-3 storage between steps), unlike the default plugin (offload run: a
    block's slots hold the shards after its forward). FSDP2 is given the same."""
    rec = world2[0][("no_reshard", "ours")]
    assert rec["plugin"]["reshard_after_forward"] is False
    assert world2[0][("no_reshard", "fsdp2")]["probe"]["after_step"][1]["reshard_after_forward"] is False
    blocks = _units(rec, "after_forward", root=False)
    assert len(blocks) == 2 and all(u["reshard_after_forward"] is False for u in rec["probe"]["before"])
    assert all(u["slots"] == "unsharded" and u["unsharded_bytes"] > 0 for u in blocks), blocks
    assert all(u["slots"] == "sharded" and u["unsharded_bytes"] == 0 for u in _units(rec, "after_backward")), \
        _units(rec, "after_backward")
    default = _units(world2[0][("offload", "ours")], "after_forward", root=False)
    assert all(u["reshard_after_forward"] and u["slots"] == "sharded" for u in default), default
    _trains_like_fsdp2(world2, "no_reshard", steps=3)


def test_zero2_sharding_strategy_trains_like_fsdp2(world2):
    """reshard_after_forward=False with ours patched in as
    partial(fully_shard, sharding_strategy="optim_grads") (our ZeRO-2: the gathered
    parameters stay between steps, gathered again only after the optimizer changed the
    shards) against FSDP2's reshard_after_forward=False: the units are optim_grads and hold
    their unsharded storage after backward and after the optimizer step too."""
    rec = world2[0][("zero2", "ours")]
    assert all(u["sharding_strategy"] == "optim_grads" for u in rec["probe"]["before"])
    for phase in ("after_backward", "after_step"):
        assert all(u["unsharded_bytes"] > 0 for u in _units(rec, phase)), (phase, _units(rec, phase))
    _trains_like_fsdp2(world2, "zero2", steps=3, reference=SHARED_REFERENCE["zero2"])  # the same plugin


def test_cpu_offload_trains_like_fsdp2(world2):
    """cpu_offload=True (the plugin's CPUOffloadPolicy(), pin_memory=True): every unit of
    ours is offloaded (its shard, gradient and so optimizer state in host memory; nothing
    to pin without an accelerator). FSDP2 cannot pin without an accelerator: its
    fully_shard raises under this plugin on a CPU-only machine (peer behaviour), and the
    reference is FSDP2 with cpu_offload=CPUOffloadPolicy(pin_memory=False)."""
    rec = world2[0][("offload", "ours")]
    assert rec["plugin"]["cpu_offload"] == "CPUOffloadPolicy(pin_memory=True)"
    assert "fsdp2_error" not in rec
    assert len(rec["probe"]["before"]) == 3 and all(u["offloaded"] for u in rec["probe"]["before"])
    assert not any(u["offloaded"] for u in world2[0][("no_reshard", "ours")]["probe"]["before"])
    theirs = world2[0][("offload", "fsdp2")]
    assert theirs["plugin"]["cpu_offload"] in ("CPUOffloadPolicy(pin_memory=True)",
                                               "CPUOffloadPolicy(pin_memory=False)"), theirs["plugin"]
    assert all(u["offload"] == "CPUOffloadPolicy" for u in theirs["probe"]["before"])
    _trains_like_fsdp2(world2, "offload", steps=3)


def test_hsdp_parallelism_config_trains_like_fsdp2(world4):
    """ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) at world 4: every unit of
    ours is on Accelerate's 2-D (dp_replicate, dp_shard_cp) mesh, sharded over 2 ranks (each
    holds half the elements, not a quarter; its replica the same), replicated over the other 2; the
    4 ranks see 4 different batches. Losses, norms on all 4 ranks, gradients, parameters."""
    rec = world4[0][("hsdp", "ours")]
    for u in rec["probe"]["before"]:
        assert u["mesh"] == [["dp_replicate", "dp_shard_cp"], [2, 2]] and u["shard_group_size"] == 2, u
    assert world4[0][("hsdp", "fsdp2")]["probe"]["before"][0]["mesh"] == [["dp_replicate", "dp_shard_cp"], [2, 2]]
    full = {n: g.size for n, g in rec["steps"][0]["grad_pre"].items()}
    for rank in range(4):
        local = world4[rank][("hsdp", "ours")]["probe"]["local_numel"]
        assert local.keys() == full.keys()
        pair = world4[rank ^ 1][("hsdp", "ours")]["probe"]["local_numel"]  # the other rank of its shard group
        assert all(local[n] + pair[n] == full[n] for n in full), rank
        assert 0.4 < sum(local.values()) / sum(full.values()) < 0.6, rank
        assert world4[rank ^ 2][("hsdp", "ours")]["probe"]["local_numel"] == local  # its replica
    firsts = [world4[r][("hsdp", "ours")]["losses"][0] for r in range(4)]
    assert len(set(firsts)) == 4, firsts
    _trains_like_fsdp2(world4, "hsdp", steps=2)



def test_explicit_buckets_train_like_fsdp2(world2):
    """Ours patched in as partial(fully_shard, gather_bucket_bytes=BUCKET_BYTES,
    reduce_bucket_bytes=BUCKET_BYTES) under the default plugin: every unit took the
    budget (the root's bucket_budgets()), the root and layer 0 share a gather bucket and a
    reduce bucket, layer 1 has its own, and a backward issues one reduce-scatter per
    bucket (2, not 3); with accumulate's no_sync micro-batches. Against FSDP2's default."""
    rec = world2[0][("buckets", "ours")]
    b = rec["probe"]["buckets"]
    assert b["budgets"] == (BUCKET_BYTES, BUCKET_BYTES), b
    for plan in ("gather", "reduce"):
        assert sorted(len(m) for m in b[plan]) == [1, 2], b
    assert rec["probe"]["reduce_scatter_calls"] == 2, rec["probe"]
    default = world2[0][("no_reshard", "ours")]["probe"]  # "auto"
    assert default["buckets"]["budgets"] != b["budgets"]
    _trains_like_fsdp2(world2, "buckets", steps=3)


@pytest.mark.parametrize("name,strategy", [("zero1", "optim"), ("no_shard", "no_shard")])
def test_zero1_and_no_shard_train_like_fsdp2(world2, name, strategy):
    """Ours patched in as partial(fully_shard, sharding_strategy="optim" / "no_shard")
    under FullyShardedDataParallelPlugin(reshard_after_forward=False), against FSDP2 under
    that plugin (the same mathematics: only where the values live differs): every unit
    has the strategy; ZeRO-1 keeps its gathered parameters after backward and after the
    step and shards its parameters (half the elements a rank), no_shard holds every
    element on every rank. The default plugin (reshard_after_forward=True) with ZeRO-1 is
    refused by name at prepare."""
    rec = world2[0][(name, "ours")]
    if name == "zero1":
        assert REFUSED_DEFAULT_PLUGIN in rec["default_plugin_error"], rec.get("default_plugin_error")
    assert all(u["sharding_strategy"] == strategy for u in rec["probe"]["before"]), rec["probe"]["before"]
    full = {n: g.size for n, g in rec["steps"][0]["grad_pre"].items()}
    local = rec["probe"]["local_numel"]
    if strategy == "no_shard":
        assert local == full
    else:
        assert 0.4 < sum(local.values()) / sum(full.values()) < 0.6
        for phase in ("after_backward", "after_step"):
            assert all(u["unsharded_bytes"] > 0 for u in _units(rec, phase)), (phase, _units(rec, phase))
    _trains_like_fsdp2(world2, name, steps=3, reference=SHARED_REFERENCE[name])


def test_dynamo_backend_compiles_and_trains_like_fsdp2(world2):
    """Accelerator(dynamo_backend="AOT_EAGER"): Accelerate's FSDP2 path compiles the whole
    model and then calls fully_shard on its layers and on the compiled module; Dynamo made
    graphs, ours' units are the usual three. Against FSDP2 eager under the default plugin
    (FSDP2 under the same dynamo_backend was checked by hand: the same losses to 1e-7)."""
    rec = world2[0][("compile", "ours")]
    assert rec["graphs"] > 0 and world2[0][("buckets", "fsdp2")]["graphs"] == 0
    assert len(rec["probe"]["before"]) == 3
    _trains_like_fsdp2(world2, "compile", steps=3, reference=SHARED_REFERENCE["compile"])


def test_bf16_mixed_precision_trains_like_fsdp2(world2):
    """Accelerator(mixed_precision="bf16"): the plugin's MixedPrecisionPolicy(bf16 params,
    reductions and outputs) reaches every unit of ours, against FSDP2 under the same.
    Tolerance 1e-2 relative: gradients reduced in bf16 (8 bits of mantissa) by our
    reduce-scatter and by FSDP2's may round differently; the losses in fact agree exactly."""
    rec = world2[0][("bf16", "ours")]
    assert all(u["param_dtype"] == "torch.bfloat16" and u["reduce_dtype"] == "torch.bfloat16"
               for u in rec["probe"]["before"]), rec["probe"]["before"]
    assert_tree_close(rec["losses"], world2[0][("bf16", "fsdp2")]["losses"], "bf16 losses", rtol=0, atol=0)
    _trains_like_fsdp2(world2, "bf16", steps=3, rtol=1e-2, atol=1e-3)


def test_fp8_gather_through_accelerates_torchao_recipe_trains_like_fsdp2():
    """Accelerator(mixed_precision="fp8") with AORecipeKwargs(config=Float8LinearConfig(
    enable_fsdp_float8_all_gather=True)): Accelerate's prepare converts 13 of the 14
    Linears of the model to Float8Linear (its default filter skips the first, layer 0's
    q_proj, and the last, lm_head), hooks torchao's precompute_float8_dynamic_scale_for_fsdp
    to the optimizer and shards with the plugin's "fp8" policy (bf16 params and
    reductions). Every layer unit of ours gathers its Float8Linear weights as FP8 bytes, and
    every Float8Linear forward, ours and FSDP2's, sees a Float8TrainingTensor weight.
    Against FSDP2 + torchao's FP8 gather under the same: every micro-batch's loss and every
    full gradient before the clip equal bit for bit; clip norms, the parameters after and
    what save_pretrained wrote to 1e-6 relative (the clip norm's fp32 sum runs over
    differently cut shards: a few ulps; the parameters follow through the clip factor);
    acc.reduce's mean of the bf16 losses at bf16 rounding."""
    from harness.accelerate_feature_workers import accelerate_features

    pytest.importorskip("torchao.float8", reason="Accelerate's FP8 path needs torchao")
    per_rank = run_distributed(accelerate_features, 2, ("fp8",), timeout=300)
    ours, theirs = per_rank[0][("fp8", "ours")], per_rank[0][("fp8", "fsdp2")]
    assert all(u["param_dtype"] == u["reduce_dtype"] == "torch.bfloat16" for u in ours["probe"]["before"])
    for rec in (ours, theirs):
        assert rec["probe"]["float8_linears"] == 13
        assert rec["probe"]["float8_forward_weights"] == ["Float8TrainingTensor"] * 13, rec["probe"]
    projections = ["mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.o_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]
    want = {"LlamaForCausalLM (root)": [], "model.layers.0": [p for p in projections if "q_proj" not in p],
            "model.layers.1": projections}
    assert {u["label"]: u["fp8_weights"] for u in ours["probe"]["before"]} == want, ours["probe"]["before"]
    assert all(u["gathers_bytes"] == bool(want[u["label"]]) for u in ours["probe"]["before"])
    for rank, res in enumerate(per_rank):
        assert_tree_close(res[("fp8", "ours")]["losses"], res[("fp8", "fsdp2")]["losses"], f"rank {rank} losses",
                          rtol=0, atol=0)
        norms = [[s["norm"] for s in res[("fp8", system)]["steps"]] for system in ("ours", "fsdp2")]
        assert_tree_close(*norms, f"rank {rank} clip norms", rtol=1e-6, atol=0)
    grads = [s["grad_pre"] for s in ours["steps"]], [s["grad_pre"] for s in theirs["steps"]]
    assert_tree_close(*grads, "full gradients before the clip", rtol=0, atol=0)
    assert_tree_close(ours["params"], theirs["params"], "final parameters", rtol=1e-6, atol=1e-7)
    assert_tree_close(ours["save_pretrained"], theirs["save_pretrained"], "save_pretrained", rtol=1e-6, atol=1e-7)
    # The rest (acc.gather / acc.reduce of the bf16 losses: reduce's mean is rounded to bf16;
    # the clip acting at every step; save_pretrained wrote the trained values), at bf16's.
    _trains_like_fsdp2(per_rank, "fp8", steps=3, rtol=1e-2, atol=1e-3)
