"""torch's pipelining (torch.distributed.pipelining) over stages sharded by our fully_shard
trains as over FSDP2's, and as one plain process (Gloo, CPU, fp32).

Our modules are torch FSDPModules and `fully_shard.state(m)` is our fsdp2_view, so torch's
PipelineStage and schedules drive our units as they drive FSDP2's: per micro-batch
set_requires_gradient_sync(False) / set_reshard_after_backward(False), one
perform_reduce_grad per stage and step (the view's post_backward of every unit, then its
final callback), and in the runtime schedules UNSHARD (unshard(async_op=True)) / RESHARD
actions. Each schedule trains 3 AdamW steps of 4 micro-batches on a (pp 2, dp 2) mesh
(harness/pp_workers.py); per step the micro-batch losses, every full gradient after the
reduction and torch's get_total_norm over each rank's stages and, at the end, every full
parameter equal FSDP2's and the plain model's within 1e-5 (relative). What the schedule
does to our units is checked too: no reduce-scatter during the micro-batches' backwards
and one per unit in the stage's REDUCE_GRAD; in the runtime schedules every FSDPModule
unshard(async_op=True)-ed once a step and already gathered when its first forward starts;
nothing left gathered after a step.

The launches share each world's processes between schedules: on 2 cores a rank spends
~3 s importing torch.distributed.pipelining (torch._dynamo) and warming up DTensor.

With other features (one world-4 launch, 1F1B and the interleaved 1F1B runtime schedule
for each; HSDP at world 8), the same comparisons against FSDP2 under the same code and the
plain model: ZeRO-2 in FSDP2's spelling (reshard_after_forward=False) and ours
(sharding_strategy="optim_grads"); ZeRO-1 ("optim") and no_shard, against FSDP2 with
reshard_after_forward=False (it has neither; the values are the same); CPU offload
(CPUOffloadPolicy in both); HSDP (pp 2 x dp_replicate 2 x dp_shard 2); and DCP: both
systems save the stages and their optimizers after step 1 and fresh pipelines built from
other weights resume from them, each checkpoint into each system; ours' explicit gather /
reduce buckets (FSDP2 has none; each stage's root reports them and its schedule planned
them); and torch.compile of every block (before fully_shard, as torchtitan orders it, in
both systems; every block forward ran compiled code).
"""
import pytest

from harness import run_distributed
from harness import pp_workers as w
from harness.pp_workers import (N_MICRO, check_gathered_bytes, check_parity, check_reduced_once_per_step,
                                check_unit_options, check_unsharded_ahead)

TOL = w.TOL
STEPS = 3
ONE_STAGE = ["gpipe", "1f1b"]  # PipelineScheduleSingle: no UNSHARD / RESHARD actions
RUNTIME = ["interleaved_1f1b", "looped_bfs"]  # _PipelineScheduleRuntime, 2 stages per rank
# Split backward (BACKWARD_INPUT, then BACKWARD_WEIGHT), V-shaped or looped, 2 stages per rank.
SPLIT_BACKWARD = ["zbv", "interleaved_zb", "dualpipev"]


@pytest.fixture(scope="module")
def dp_reports():
    """One world-4 launch running every schedule that uses full backwards."""
    runs = [{"schedule": s} for s in ONE_STAGE + RUNTIME]
    per_rank = run_distributed(w.pp_parity, 4, runs, STEPS, TOL, timeout=300)
    return {s: [r[s] for r in per_rank] for s in ONE_STAGE + RUNTIME}


@pytest.mark.parametrize("schedule", ONE_STAGE + RUNTIME)
def test_schedule_matches_fsdp2_and_plain(dp_reports, schedule):
    reports = dp_reports[schedule]
    check_parity(reports, schedule)
    check_reduced_once_per_step(reports, schedule)
    if schedule in RUNTIME:
        check_unsharded_ahead(reports, schedule)
    else:  # nothing unshards ahead: each unit gathers in its own forward (the spy sees it sharded there)
        for r in reports:
            for c in r["control"]:
                assert c["unshards"] == [] and not any(c["gathered_at_first_forward"].values()), c


def test_tensor_parallel_stages():
    """(pp 2, dp 2, tp 2) at world 8: the blocks tensor-parallel, both systems sharding on
    mesh["dp"]; the interleaved 1F1B runtime schedule (UNSHARD / RESHARD on TP units)."""
    schedule = "interleaved_1f1b"
    per_rank = run_distributed(w.pp_parity, 8, [{"schedule": schedule}], STEPS, TOL, timeout=300)
    reports = [r[schedule] for r in per_rank]
    # 2 stages x 2 blocks x (w1 and w2, weight and bias): DTensors on the tp mesh
    assert all(r["tp_params"] == 16 for r in reports), [r["tp_params"] for r in reports]
    check_parity(reports, schedule)
    check_reduced_once_per_step(reports, schedule)
    check_unsharded_ahead(reports, schedule)


def test_split_backward_schedules():
    """ZBV, interleaved zero-bubble and DualPipeV with reshard_after_forward=False for every
    unit, in both systems: FSDP2 trains like the plain model only so. With FSDP2's default
    (blocks resharded after forward) torch 2.13 loses weight gradients: stage_backward_input
    finds the blocks' sharded parameters in submod.parameters(), whose gradient edges are not
    in the graph (measured on FSDP2: the last stage gets no gradient at all, stages 1 and 2
    rel. errors 0.48 to 0.93). Our units pass because a unit keeps its unsharded parameters
    in the module's slots between micro-batches (sync off, reshard_after_backward False),
    as FSDP2 does: torch's stage_backward_input and stage_backward_weight each read the
    weights from submod.parameters(), on both sides of our post-backward hook."""
    runs = [{"schedule": s, "reshard_after_forward": False} for s in SPLIT_BACKWARD]
    per_rank = run_distributed(w.pp_parity, 4, runs, STEPS, TOL, timeout=300)
    for schedule in SPLIT_BACKWARD:
        reports = [r[schedule] for r in per_rank]
        check_parity(reports, schedule)
        check_reduced_once_per_step(reports, schedule)


BUCKET_BYTES = 6000
FEATURE_SCHEDULES = ["1f1b", "interleaved_1f1b"]  # one stage per rank; two, with UNSHARD / RESHARD
FEATURES = {
    "zero2": {"reshard_after_forward": False},  # FSDP2's ZeRO-2, in both systems
    "optim_grads": {"strategy": "optim_grads"},  # ours' ZeRO-2 (Megatron's name)
    "optim": {"strategy": "optim"},  # ZeRO-1: full gradients all-reduced, optimizer state sharded
    "no_shard": {"strategy": "no_shard"},
    "offload": {"offload": True},
    "dcp": {"dcp": 1},  # checkpoint at the start of step 1 of 3
    # ours' explicit buckets (FSDP2 has none): the stage module's units in forward order are
    # root 1,088 B, blocks 4,288 B each: 6,000 B makes the buckets [root, blocks.0], [blocks.1]
    "buckets": {"gather_bucket_bytes": BUCKET_BYTES, "reduce_bucket_bytes": BUCKET_BYTES},
    "compile": {"compile": True},  # each block compiled (aot_eager, fullgraph), then sharded
}


@pytest.fixture(scope="module")
def feature_reports(tmp_path_factory):
    """One world-4 launch: every feature under each of FEATURE_SCHEDULES."""
    runs = [{"schedule": s, "name": f"{f}-{s}", **opts} for f, opts in FEATURES.items() for s in FEATURE_SCHEDULES]
    folder = str(tmp_path_factory.mktemp("pp_dcp"))
    per_rank = run_distributed(w.pp_parity, 4, runs, STEPS, TOL, folder, timeout=600)
    return {r["name"]: [ranks[r["name"]] for ranks in per_rank] for r in runs}


def _control_checks(reports, schedule, **reductions):
    check_parity(reports, schedule)
    check_reduced_once_per_step(reports, schedule, **reductions)
    if schedule in RUNTIME:
        check_unsharded_ahead(reports, schedule)


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
@pytest.mark.parametrize("feature", ["zero2", "optim_grads"])
def test_zero2_stages(feature_reports, feature, schedule):
    """ZeRO-2: each unit gathered once a step (kept from its first forward to the stage's
    REDUCE_GRAD, where its gradients are reduce-scattered once), against FSDP2's
    reshard_after_forward=False and the plain model. ZeRO-3 (the default runs above)
    gathers more."""
    reports = feature_reports[f"{feature}-{schedule}"]
    _control_checks(reports, schedule)
    check_gathered_bytes(reports, schedule, "once")
    check_unit_options(reports, schedule, strategy="optim_grads_params" if feature == "zero2" else "optim_grads",
                       reshard_after_forward=False, offloaded=False, shard_size=2, replicate_size=1)
    check_gathered_bytes(feature_reports[f"dcp-{schedule}"], schedule, "more")  # ZeRO-3 (default), for contrast


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_zero1_and_no_shard_stages(feature_reports, strategy, schedule):
    """ZeRO-1 and no_shard: no reduce-scatter, the full gradients all-reduced only in the
    stage's REDUCE_GRAD (besides every unit's small all-reduce, at least one more per
    unit); ZeRO-1 gathers each unit once a step, no_shard never."""
    reports = feature_reports[f"{strategy}-{schedule}"]
    _control_checks(reports, schedule, kind="reduce_scatter", per_unit=0)
    check_reduced_once_per_step(reports, schedule, kind="all_reduce", per_unit=2)
    check_gathered_bytes(reports, schedule, "once" if strategy == "optim" else "none")
    check_unit_options(reports, schedule, strategy=strategy, reshard_after_forward=False, offloaded=False,
                       shard_size=2, replicate_size=1)


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
def test_cpu_offload_stages(feature_reports, schedule):
    """CPUOffloadPolicy in both systems: every unit of ours offloaded (the shards, their
    gradients and so AdamW's state in host memory: here the CPU is the device too)."""
    reports = feature_reports[f"offload-{schedule}"]
    _control_checks(reports, schedule)
    check_unit_options(reports, schedule, strategy="optim_grads_params", reshard_after_forward=True,
                       offloaded=True, shard_size=2, replicate_size=1)


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
def test_dcp_resume_and_interchange(feature_reports, schedule):
    """Both systems save their stages' model and optimizer state dicts (torch's
    get_model_state_dict / get_optimizer_state_dict per stage, dcp.save) at the start of
    step 1 of 3; fresh pipelines built from other weights load them (dcp.load,
    set_model_state_dict / set_optimizer_state_dict) and train steps 1 and 2: ours from
    ours' checkpoint equals ours uninterrupted bit for bit (losses, every gradient, the
    values after); ours from FSDP2's and FSDP2 from ours' train like the plain model and
    FSDP2 (check_parity covers all five runs)."""
    reports = feature_reports[f"dcp-{schedule}"]
    _control_checks(reports, schedule)
    for r in reports:
        assert set(r["worst"]) == {"fsdp2", "ours", "ours_from_ours", "ours_from_fsdp2", "fsdp2_from_ours"}, r["worst"]
        assert r["worst"]["ours_from_ours"]["steps"] == 2 and r["worst"]["fsdp2_from_ours"]["steps"] == 2
        for what in ("loss vs ours", "grad vs ours", "param vs ours"):
            assert r["worst"]["ours_from_ours"][what] == 0.0, (what, r["worst"]["ours_from_ours"])
        # the resumed pipelines of ours reduce once per unit per step, as the uninterrupted one
        for name in ("ours_from_ours", "ours_from_fsdp2"):
            check_reduced_once_per_step([{**r, "control": r["controls"][name]}], f"{schedule} {name}")


def test_hsdp_stages():
    """(pp 2, dp_replicate 2, dp_shard 2) at world 8, both systems sharding on the 2-D
    (dp_replicate, dp_shard) mesh: each unit shards over its dp_shard row and is
    replicated over 2; its gradients are reduce-scattered once in REDUCE_GRAD and
    all-reduced across the replicas there (against the plain model on the whole batch:
    without that all-reduce each replica would hold its half batch's gradient)."""
    runs = [{"schedule": s, "hsdp": True} for s in FEATURE_SCHEDULES]
    per_rank = run_distributed(w.pp_parity, 8, runs, STEPS, TOL, timeout=300)
    for schedule in FEATURE_SCHEDULES:
        reports = [r[schedule] for r in per_rank]
        _control_checks(reports, schedule)
        check_reduced_once_per_step(reports, schedule, kind="all_reduce", per_unit=2)
        check_unit_options(reports, schedule, strategy="optim_grads_params", reshard_after_forward=True,
                           offloaded=False, shard_size=2, replicate_size=2)


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
def test_explicit_buckets_stages(feature_reports, schedule):
    """gather_bucket_bytes / reduce_bucket_bytes of 6,000 B on every unit of ours (the
    stage module's value governs its tree): each stage's root reports them in
    bucket_budgets(), and its schedule cut the recorded forward order [root, blocks.0,
    blocks.1] into the gather buckets [root, blocks.0], [blocks.1]; every micro-batch's
    forward and backward gathers through them, against FSDP2 (no buckets) and the plain
    model. (Without explicit buckets, the runs above plan theirs from "auto": on Gloo it
    measured 4 to 32 MiB, one gather and one reduce bucket per stage.)"""
    reports = feature_reports[f"buckets-{schedule}"]
    _control_checks(reports, schedule)
    check_unit_options(reports, schedule, strategy="optim_grads_params", reshard_after_forward=True,
                       offloaded=False, shard_size=2, replicate_size=1)
    for r in reports:
        assert sorted(r["buckets"]) == sorted(r["stages"]), r["buckets"]
        for s, plan in r["buckets"].items():
            names = [f"{s}:root", f"{s}:blocks.0", f"{s}:blocks.1"]
            assert plan["budgets"] == (BUCKET_BYTES, BUCKET_BYTES), plan
            assert plan["order"] == names, plan
            assert plan["gather"] == [names[:2], names[2:]], plan
        units = {o["unit"]: o["unsharded_nbytes"] for o in r["unit_options"]}
        assert all(units[f"{s}:root"] + units[f"{s}:blocks.0"] <= BUCKET_BYTES
                   < units[f"{s}:root"] + units[f"{s}:blocks.0"] + units[f"{s}:blocks.1"] for s in r["stages"]), units
    check_gathered_bytes(reports, schedule, "more")  # ZeRO-3: gathered again for later micro-batches


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
def test_reduce_buckets_in_reduce_grad(feature_reports, schedule):
    """With reduce_bucket_bytes 6,000 B the stage's units reduce in the buckets [root,
    blocks.0], [blocks.1]: 2 coalesced reduce-scatters per stage in its REDUCE_GRAD, not 3
    (the schedule's REDUCE_GRAD reduces what the micro-batches accumulated through the
    stage's reduce buckets, as a synced backward does)."""
    for r in feature_reports[f"buckets-{schedule}"]:
        for s, plan in r["buckets"].items():
            assert plan["reduce"] == [[f"{s}:root", f"{s}:blocks.0"], [f"{s}:blocks.1"]], plan
        for c in r["control"]:
            assert all(during == 2 for _, _, during in c["reduce_grads"]), c["reduce_grads"]


@pytest.mark.parametrize("schedule", FEATURE_SCHEDULES)
def test_compiled_blocks_stages(feature_reports, schedule):
    """Each block compiled before fully_shard (torchtitan's order: block.compile(fullgraph=
    True), aot_eager), in both systems: every forward of every block of the rank's stages
    ran compiled code (the stage's metadata inference, then 4 micro-batches a step), as
    many calls under ours as under FSDP2, with the same losses, gradients and values."""
    reports = feature_reports[f"compile-{schedule}"]
    _control_checks(reports, schedule)
    for r in reports:
        forwards = 1 + N_MICRO * STEPS
        want = forwards * 2 * len(r["stages"])  # 2 blocks per stage
        calls = {system: c["calls"] for system, c in r["compiled"].items()}
        assert calls == {"fsdp2": want, "ours": want}, (calls, want)
