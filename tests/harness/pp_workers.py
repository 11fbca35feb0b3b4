"""torch's pipelining (torch.distributed.pipelining) driving stages sharded by our
fully_shard, against the same schedule over FSDP2 (torch's fully_shard) and one plain
process.

A stack of residual MLP blocks is cut into stages, each a module holding two blocks and a
projection of its own. Every block is fully_shard-ed, then the stage module (the root of
its units, with parameters of its own). FSDP2 and ours each train deep copies of one
plain model with the same schedule, batches and AdamW, one after the other in the same
processes; every step compares the per-micro-batch losses the schedule returns, every
full gradient after the step's reduction (before the optimizer), torch's get_total_norm
over the rank's stages (global through our ShardedGrad types) and, at the end, every full
parameter, against FSDP2 and against the plain model on the whole global batch.

For our units the worker also records the schedule's control over them: the
reduce-scatters of a step (none during the micro-batches' backwards, each stage's units
once at the schedule's REDUCE_GRAD), the schedule's unshard(async_op=True) calls and
whether each unit was already gathered when its first forward of a step began, and that
no unit is left gathered after a step.

Meshes: (pp, dp) at world 4; (pp, dp, tp) at world 8 with the blocks tensor-parallel
(torch's parallelize_module on "tp"); both systems shard on mesh["dp"]; or HSDP's
(pp, dp_replicate, dp_shard) at world 8, both systems sharding on (dp_replicate, dp_shard).

Per run, other features in both systems (pp_parity's run keys): reshard_after_forward,
ours' sharding_strategy (FSDP2 then runs reshard_after_forward=False: same values),
ours' gather_bucket_bytes / reduce_bucket_bytes, every block compiled before fully_shard
(aot_eager; the compiled calls counted per system), CPUOffloadPolicy, and a DCP
checkpoint of every stage's model and optimizer state at a step, from which fresh
pipelines resume (ours from ours' and FSDP2's, FSDP2 from ours'); or torchao's FP8
all-gather (every Linear converted by convert_to_float8_training before fully_shard, bf16
parameters, torchao's scales precomputed after each step as torchtitan does), where the
plain fp32 model is only a sanity bound ("plain_tol") and FSDP2 + torchao the reference.
The report then also says what each of our units took (strategy, reshard_after_forward,
offloaded, shard and replicate sizes, the shard group's ranks, the parameters gathered in
FP8), what the all-gathers of each step moved, in bytes (bucket plans change the calls,
not the bytes), each stage root's bucket budgets and the buckets its schedule planned,
and under FP8 the weight types the layers' forwards saw.
"""
from __future__ import annotations

import copy
import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.states import SlotsHold

from .fp8_workers import bf16_policy, fp8_gathered, fp8_gathered_names
from .observe import counting_aot_eager, schedule_buckets
from .workers import device_for_backend, flat_piece, rel_err, shard_piece

D, H = 16, 32
N_MICRO = 4
ROWS = 2 * N_MICRO  # rows per data-parallel rank and step: micro-batches of 2
SEED = 11
LR = 1e-2

# name -> (torch class, stages per pp rank, how stages map to ranks: "loop" (s % pp) or "v")
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Stage(nn.Module):
    """One pipeline stage: two blocks (units of their own) and a projection held by the
    stage module itself, so its root unit has parameters too."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.proj(x)


# opts["compile"]: what the blocks' compiled code did, per system ("current", set by _train):
# graphs compiled and calls of their compiled forward (aot_eager: no inductor toolchain needed).
COMPILED: Dict = {"graphs": {}, "calls": {}, "current": None}


counting_backend = counting_aot_eager(COMPILED)


def build_plain(num_stages: int, seed: int = SEED) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Stage() for _ in range(num_stages))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target, reduction="sum")  # (opts["fp8"]: bf16 outputs)


def stage_indices(pp_rank: int, pp: int, per_rank: int, style: str) -> List[int]:
    if style == "v":  # rank r holds stages r and 2*pp-1-r
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def make_mesh(world: int, hsdp: bool = False):
    """(pp, dp) at world 4; at world 8 (pp, dp, tp), or with `hsdp` (pp, dp_replicate,
    dp_shard) whose two data-parallel dims are also flattened into "dp" (the batch rows,
    the loss sum)."""
    kind = device_for_backend().type
    if world == 4:
        return init_device_mesh(kind, (2, 2), mesh_dim_names=("pp", "dp"))
    if world == 8 and hsdp:
        mesh = init_device_mesh(kind, (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        return mesh
    if world == 8:
        return init_device_mesh(kind, (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    raise ValueError(f"no mesh for world {world}")


def tensor_parallel(stage: Stage, tp_mesh) -> None:
    """Megatron's TP on each block: w1 column-, w2 row-parallel (plain tensors in and out,
    so the stages exchange plain activations)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in stage.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def shard_mesh(mesh):
    """What both systems shard on: mesh["dp"], or HSDP's (dp_replicate, dp_shard)."""
    if "dp_shard" in mesh.mesh_dim_names:
        return mesh[("dp_replicate", "dp_shard")]
    return mesh["dp"]


def shard(stage: Stage, system: str, dp_mesh, opts: Dict) -> Stage:
    """Blocks first, then the stage module; each system's own default when
    opts["reshard_after_forward"] is None. opts["strategy"] (ours: sharding_strategy; FSDP2
    has only ZeRO-3 and, for every other strategy, reshard_after_forward=False, which
    computes the same values), opts["offload"] (CPUOffloadPolicy in both),
    opts["gather_bucket_bytes"] / opts["reduce_bucket_bytes"] (ours' fully_shard, every
    unit: the stage module's value governs its tree; FSDP2 has none) and opts["fp8"]
    (bf16 parameters and fp32 reduction in both, as the FP8 tests train)."""
    reshard_after_forward, strategy = opts.get("reshard_after_forward"), opts.get("strategy")
    kw = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    if opts.get("fp8"):
        kw["mp_policy"] = bf16_policy(system)
    if opts.get("offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if system == "ours":
        if strategy is not None:
            kw["sharding_strategy"] = strategy
        for name in ("gather_bucket_bytes", "reduce_bucket_bytes"):  # ours only (FSDP2 has no buckets)
            if name in opts:
                kw[name] = opts[name]
        for b in stage.blocks:
            mfsdp.fully_shard(b, mesh=dp_mesh, **kw)
        return mfsdp.fully_shard(stage, mesh=dp_mesh, **kw)
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if strategy not in (None, "optim_grads_params"):
        kw["reshard_after_forward"] = False

    for b in stage.blocks:
        fully_shard(b, mesh=dp_mesh, **kw)
    fully_shard(stage, mesh=dp_mesh, **kw)
    for m in stage.modules():  # Gloo's reduce-scatter has no average: SUM, then FSDP2's division
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return stage


def full_grads_of_ours(stage: nn.Module, dp_group, tp_placements: Dict[str, tuple], tp_mesh,
                       replicated: bool = False) -> Dict:
    """Every parameter's full gradient: the dp ranks' 1-D pieces placed by the unit's
    layout (checked to cover it exactly once; `replicated` (no_shard): whole and equal on
    every rank) and, for TP parameters, the tp ranks' local shards joined as TP placed
    them. None where no rank has a gradient. `dp_group`: the group the units shard over."""
    local = {}
    for name, p in stage.named_parameters():
        state, idx, piece = shard_piece(p)
        g = None if p.grad is None else flat_piece(p.grad).cpu().clone()
        local[name] = (piece.param_offset, tuple(state.unit.param_spec(idx).shape), g)
    every = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(every, local, group=dp_group)
    full = {}
    for name, (_, shape, _) in local.items():
        pieces = [by_rank[name] for by_rank in every]
        have = [g is not None for _, _, g in pieces]
        assert all(have) or not any(have), f"'{name}': gradient None on some dp ranks only: {have}"
        if not any(have):
            full[name] = None
            continue
        if replicated:  # no_shard: every rank holds the whole gradient, the same on every rank
            for offset, _, g in pieces:
                assert offset == 0 and torch.equal(g, pieces[0][2]), f"'{name}': replicated gradients differ"
            pieces = pieces[:1]
        out = torch.zeros(shape).reshape(-1)
        covered = torch.zeros(out.numel(), dtype=torch.int32)
        for offset, _, g in pieces:
            out[offset: offset + g.numel()] = g
            covered[offset: offset + g.numel()] += 1
        assert bool((covered == 1).all()), f"'{name}': gradient pieces do not tile the parameter"
        t = out.reshape(shape).to(device_for_backend())
        if name in tp_placements:
            t = DTensor.from_local(t, tp_mesh, tp_placements[name], run_check=False).full_tensor()
        full[name] = t
    return full


def full_grads_of_fsdp2(stage: nn.Module) -> Dict:
    return {n: None if p.grad is None else p.grad.full_tensor().detach().clone()
            for n, p in stage.named_parameters()}


def full_params(stage: nn.Module, system: str) -> Dict[str, torch.Tensor]:
    if system == "ours":
        return dict(mfsdp.full_state_dict(stage, rank0_only=False))
    return {n: p.full_tensor().detach().clone() for n, p in stage.named_parameters()}


def batches(steps: int, dp: int):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(dp * ROWS, D, generator=g), torch.randn(dp * ROWS, D, generator=g)) for _ in range(steps)]


class ScheduleSpy:
    """What the schedule does to our units during a step, each FSDPModule keyed
    "<stage index>:<module path in the stage>": every unshard call (key, async_op) and the
    waits on its handles; whether each unit's slots already held the gathered parameters
    when its first forward of the step began (a forward pre-hook ahead of ours); and our
    reduce-scatters (the C++ counters) before and inside each stage's perform_reduce_grad
    (the schedule's REDUCE_GRAD); with `weight_types`, the types of the weights the Linear
    layers' forwards saw (torchao's Float8TrainingTensor where the unit gathered the
    weight in FP8), keyed "<stage index>:<layer path>"."""

    def __init__(self, stage_modules: Dict[int, nn.Module], pipeline_stages: list, weight_types: bool = False):
        self.new_step()
        for s, stage in stage_modules.items():
            for path, m in stage.named_modules():
                if isinstance(m, mfsdp.FSDPModule):
                    self._wrap_unshard(m, f"{s}:{path or 'root'}")
                if weight_types and isinstance(m, nn.Linear):
                    m.register_forward_pre_hook(
                        lambda mod, args, key=f"{s}:{path}": self.weight_types.setdefault(key, set()).add(
                            type(mod.weight).__name__))
        for ps in pipeline_stages:
            self._wrap_reduce_grad(ps)

    def new_step(self) -> None:
        self.unshards: List[tuple] = []
        self.waits = 0
        self.weight_types: Dict[str, set] = {}
        self.gathered_at_first_forward: Dict[str, bool] = {}
        self.reduce_grads: List[tuple] = []  # (stage index, reduce-scatters before it, in it)
        self.all_reduces: List[tuple] = []  # (stage index, all-reduces before it, in it)
        _C.reset_collective_counts()

    @staticmethod
    def _reduce_scatters() -> int:
        return _C.collective_counts()["reduce_scatter"][0]

    @staticmethod
    def _all_reduces() -> int:
        return _C.collective_counts()["all_reduce"][0]

    @staticmethod
    def _all_gathers() -> int:
        return _C.collective_counts()["all_gather"][0]

    @staticmethod
    def _all_gather_bytes() -> int:
        return _C.collective_counts()["all_gather"][1]

    def _wrap_unshard(self, m, key: str) -> None:
        """`key`: "<stage index>:<module path in the stage>"."""
        spy, unshard, state = self, m.unshard, m._fsdp_state

        def spied(async_op: bool = False):
            spy.unshards.append((key, async_op))
            handle = unshard(async_op=async_op)
            if handle is not None:
                wait = handle.wait

                def spied_wait():
                    spy.waits += 1
                    wait()
                handle.wait = spied_wait
            return handle
        m.__dict__["unshard"] = spied

        def pre(module, args):  # registered after fully_shard, prepended: runs before our pre-forward
            spy.gathered_at_first_forward.setdefault(key, state.slots_hold is SlotsHold.UNSHARDED)
        m.register_forward_pre_hook(pre, prepend=True)

    def _wrap_reduce_grad(self, ps) -> None:
        spy, perform = self, ps.perform_reduce_grad

        def spied(grad_scale_factor):
            before, before_ar = spy._reduce_scatters(), spy._all_reduces()
            perform(grad_scale_factor)
            spy.reduce_grads.append((ps.stage_index, before, spy._reduce_scatters() - before))
            spy.all_reduces.append((ps.stage_index, before_ar, spy._all_reduces() - before_ar))
        ps.perform_reduce_grad = spied


def _reference(plain: nn.ModuleList, data, dp: int):
    """One plain process on the whole global batch: per step the loss and the gradients
    the pipeline must produce (the schedule divides by n_microbatches, FSDP by dp)."""
    ref = copy.deepcopy(plain)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in data:
        out = x
        for stage in ref:
            out = stage(out)
        loss = loss_fn(out, y) / (N_MICRO * dp)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach() for n, p in ref.named_parameters()}


def _build_pipeline(system: str, schedule_name: str, plain: nn.ModuleList, mesh, opts: Dict) -> Dict:
    """This rank's stage modules (deep copies of `plain`'s, sharded), their PipelineStages,
    the schedule, one AdamW per stage (as torchtitan keeps one per model part) and, for
    ours, the ScheduleSpy."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    cls_name, per_rank, style = SCHEDULES[schedule_name]
    pp_mesh = mesh["pp"]
    tp_mesh = mesh["tp"] if "tp" in mesh.mesh_dim_names else None
    pp = pp_mesh.size()
    num_stages = pp * per_rank
    mine = stage_indices(pp_mesh.get_local_rank(), pp, per_rank, style)
    modules, stages, placements = {}, [], {}
    for s in mine:
        stage_mod = copy.deepcopy(plain[s])
        if tp_mesh is not None:
            tensor_parallel(stage_mod, tp_mesh)
        if opts.get("compile"):  # torchtitan's order: each block compiled, then fully_shard
            # fully_shard gives every module a class of its own (FSDP2's and ours): one
            # graph per block and input requires_grad, more than dynamo's default 8.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            for b in stage_mod.blocks:
                b.compile(fullgraph=True, backend=counting_backend)
        if opts.get("fp8"):  # torchao's FP8 training, the weights gathered in FP8, before fully_shard
            fp8_gathered(stage_mod)
        placements[s] = {n: tuple(p.placements) for n, p in stage_mod.named_parameters() if isinstance(p, DTensor)}
        modules[s] = shard(stage_mod, system, shard_mesh(mesh), opts)
        stages.append(PipelineStage(modules[s], s, num_stages, device_for_backend(), group=pp_mesh.get_group()))
    schedule = getattr(pipelining, cls_name)(stages[0] if per_rank == 1 else stages, n_microbatches=N_MICRO,
                                             loss_fn=loss_fn)
    optims = {s: torch.optim.AdamW(modules[s].parameters(), lr=LR) for s in mine}
    if opts.get("fp8"):  # torchtitan's loop: torchao's scales after each step, every model part (ours: a no-op)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        for s in mine:
            optims[s].register_step_post_hook(
                lambda opt, args, kwargs, m=modules[s]: precompute_float8_dynamic_scale_for_fsdp(m))
    spy = ScheduleSpy(modules, stages, weight_types=bool(opts.get("fp8"))) if system == "ours" else None
    return {"mine": mine, "num_stages": num_stages, "modules": modules, "stages": stages, "schedule": schedule,
            "optims": optims, "placements": placements, "spy": spy, "tp_mesh": tp_mesh}


def _checkpoint_state(pipe: Dict) -> Dict:
    """What a pipeline-parallel job saves (torchtitan's ModelWrapper / OptimizersContainer
    per model part): each stage's model and optimizer state dicts through torch's helpers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {f"stage{s}": {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, pipe["optims"][s])}
            for s, m in pipe["modules"].items()}


def _save(pipe: Dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_checkpoint_state(pipe), checkpoint_id=path)


def _load(pipe: Dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _checkpoint_state(pipe)
    dcp.load(state, checkpoint_id=path)
    for s, m in pipe["modules"].items():
        set_model_state_dict(m, state[f"stage{s}"]["model"])
        set_optimizer_state_dict(m, pipe["optims"][s], state[f"stage{s}"]["optim"])


def _unit_options(pipe: Dict, mesh) -> List[Dict]:
    """What each of our units took from fully_shard (the options reached the units), and
    the ranks of the mesh dim it must shard over (dp_shard under HSDP, else dp); its
    elements, and the parameters it gathers in FP8 (torchao's FP8 all-gather) with each
    rank's bytes of that gather."""
    shard_dim = "dp_shard" if "dp_shard" in mesh.mesh_dim_names else "dp"
    mesh_ranks = dist.get_process_group_ranks(mesh[shard_dim].get_group())
    out = []
    for s in pipe["mine"]:
        for path, m in pipe["modules"][s].named_modules():
            state = getattr(m, "_fsdp_state", None)
            if isinstance(m, mfsdp.FSDPModule) and state.unit is not None:
                u = state.unit
                out.append({"unit": f"{s}:{path or 'root'}", "strategy": state.options.sharding_strategy,
                            "reshard_after_forward": bool(state.options.reshard_after_forward),
                            "offloaded": bool(u.offloaded), "shard_size": u.world_size,
                            "replicate_size": u.replicate_size, 
                            "unsharded_nbytes": u.unsharded_nbytes,
                            "numel": sum(math.prod(sp.shape) for sp in u.param_specs),
                            "fp8": fp8_gathered_names(u),
                            "segment_bytes": list(u.gather_bytes.segment_bytes) if u.gathers_bytes else None,
                            "shard_ranks": dist.get_process_group_ranks(state.process_group),
                            "mesh_shard_ranks": mesh_ranks})
    return out


def _bucket_plans(pipe: Dict) -> Dict[int, Dict]:
    """Per stage: its root's bucket_budgets() (gather, reduce; "auto" resolved) and the
    buckets its schedule cut from the recorded forward order, by unit path (in forward
    order: the stage module first)."""
    out = {}
    for s in pipe["mine"]:
        root = pipe["modules"][s]
        names = {id(m._fsdp_state): f"{s}:{path or 'root'}" for path, m in root.named_modules()
                 if isinstance(m, mfsdp.FSDPModule)}
        out[s] = schedule_buckets(root, names)
    return out


def _train(system: str, schedule_name: str, plain: nn.ModuleList, mesh, data, opts: Dict,
           ckpt: Optional[Dict] = None) -> Dict:
    """Train `data` through the schedule. `ckpt` (DCP): {"at": step, "save": folder or None,
    "load": folder or None}: at the start of step "at" save the stages and optimizers to
    "save"; with "load", start there instead: a fresh pipeline built from other weights
    loads "load" and trains the steps from "at" on (the steps before are None)."""
    dp_mesh = mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()
    # The group the units shard over: the 1-D pieces of a gradient tile it over this group.
    grad_group = mesh["dp_shard"].get_group() if "dp_shard" in mesh.mesh_dim_names else dp_mesh.get_group()
    replicated = opts.get("strategy") == "no_shard"
    for counts in (COMPILED["graphs"], COMPILED["calls"]):  # this training's graphs and calls only
        counts.pop(system, None)
    COMPILED["current"] = system
    start = 0
    if ckpt is not None and ckpt.get("load"):
        start = ckpt["at"]
        pipe = _build_pipeline(system, schedule_name, build_plain(len(plain), SEED + 1), mesh, opts)
        _load(pipe, ckpt["load"])
    else:
        pipe = _build_pipeline(system, schedule_name, plain, mesh, opts)
    mine, modules, schedule, spy = pipe["mine"], pipe["modules"], pipe["schedule"], pipe["spy"]
    n = len(data)
    rec = {"losses": [None] * n, "grads": [None] * n, "norms": [None] * n, "control": []}
    has_first, has_last = 0 in mine, pipe["num_stages"] - 1 in mine
    rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    for step, (x, y) in enumerate(data):
        if step < start:
            continue
        if ckpt is not None and step == ckpt["at"] and ckpt.get("save"):
            _save(pipe, ckpt["save"])
        if spy is not None:
            spy.new_step()
        losses: List[torch.Tensor] = []
        schedule.step(*((x[rows],) if has_first else ()), target=y[rows] if has_last else None,
                      losses=losses if has_last else None)
        rec["losses"][step] = [l_.item() for l_ in losses]
        if spy is not None:
            rec["control"].append({
                "reduce_scatters": spy._reduce_scatters(),
                "all_reduces": spy._all_reduces(),
                "all_gathers": spy._all_gathers(),
                "all_gather_bytes": spy._all_gather_bytes(),
                "reduce_grads": list(spy.reduce_grads),
                "all_reduces_in_reduce_grad": list(spy.all_reduces),
                "unshards": list(spy.unshards),
                "waits": spy.waits,
                "weight_types": {k: sorted(v) for k, v in spy.weight_types.items()},
                "gathered_at_first_forward": dict(spy.gathered_at_first_forward),
                "left_gathered": [f"{s}:{path or 'root'}" for s in mine for path, m in modules[s].named_modules()
                                  if isinstance(m, mfsdp.FSDPModule) and m._fsdp_state.unit is not None
                                  and m._fsdp_state.unit.unsharded_storage_bytes != 0],
            })
        grads = {}
        for s in mine:
            full = (full_grads_of_ours(modules[s], grad_group, pipe["placements"][s], pipe["tp_mesh"], replicated)
                    if system == "ours" else full_grads_of_fsdp2(modules[s]))
            grads.update({f"{s}.{n}": g for n, g in full.items()})
        rec["grads"][step] = grads
        # torch's norm over this rank's stages (what torchtitan computes per pp rank before its
        # pp all-reduce): global over dp (and tp) from our gradients' ShardedGrad types. FSDP2's
        # block and projection gradients live on different meshes under TP: not stackable there.
        if system == "ours" or pipe["tp_mesh"] is None:
            norm = torch.nn.utils.get_total_norm([p.grad for s in mine for p in modules[s].parameters()
                                                  if p.grad is not None])
            rec["norms"][step] = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
        for s in mine:
            pipe["optims"][s].step()
            pipe["optims"][s].zero_grad()
    rec["params"] = {f"{s}.{n}": t for s in mine for n, t in full_params(modules[s], system).items()}
    rec["tp_params"] = sum(len(p) for p in pipe["placements"].values())
    if system == "ours":
        rec["units"] = {s: sum(1 for m in modules[s].modules()
                               if isinstance(m, mfsdp.FSDPModule) and m._fsdp_state.unit is not None) for s in mine}
        rec["modules"] = sorted(f"{s}:{path or 'root'}" for s in mine for path, m in modules[s].named_modules()
                                if isinstance(m, mfsdp.FSDPModule))
        rec["unit_options"] = _unit_options(pipe, mesh)
        rec["buckets"] = _bucket_plans(pipe)
    rec["compiled"] = {k: COMPILED[k].get(system, 0) for k in ("graphs", "calls")}
    return rec


def _compare(system: str, what: str, got, want, tol: float) -> float:
    assert got is not None, f"{system} {what}: missing (None)"
    err = rel_err(got.cpu(), want.cpu())
    assert err <= tol, f"{system} {what}: rel err {err:.3e} > {tol}"
    return err


def _trainings(schedule_name: str, plain, mesh, data, opts: Dict, folder: Optional[str]) -> Dict[str, Dict]:
    """FSDP2, then ours; with opts["dcp"] = step k (and `folder`) both save their stages and
    optimizers at step k, and three more trainings start at k from a checkpoint, each in a
    fresh pipeline built from other weights: ours from ours', ours from FSDP2's, FSDP2
    from ours'."""
    import os

    k = opts.get("dcp")
    if k is None:
        return {system: _train(system, schedule_name, plain, mesh, data, opts) for system in ("fsdp2", "ours")}
    path = {system: os.path.join(folder, f"{schedule_name}_{system}") for system in ("fsdp2", "ours")}
    recs = {system: _train(system, schedule_name, plain, mesh, data, opts, {"at": k, "save": path[system]})
            for system in ("fsdp2", "ours")}
    for name, system, source in (("ours_from_ours", "ours", "ours"), ("ours_from_fsdp2", "ours", "fsdp2"),
                                 ("fsdp2_from_ours", "fsdp2", "ours")):
        recs[name] = _train(system, schedule_name, plain, mesh, data, opts, {"at": k, "load": path[source]})
    return recs


def pp_run(rank: int, world: int, schedule_name: str, mesh, steps: int, tol: float,
           opts: Optional[Dict] = None, folder: Optional[str] = None) -> Dict:
    """One schedule: FSDP2, then ours, each against the plain model; ours against FSDP2.
    With opts["dcp"], the trainings resumed from checkpoints too (against the plain model;
    ours' against FSDP2; ours resumed from its own checkpoint against its uninterrupted
    run, bit for bit)."""
    opts = opts or {}
    plain_tol = opts.get("plain_tol", tol)  # FP8 (opts["fp8"]) against fp32: a sanity bound only
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    _, per_rank, style = SCHEDULES[schedule_name]
    num_stages = pp * per_rank
    device = device_for_backend()
    plain = build_plain(num_stages).to(device)
    data = [(x.to(device), y.to(device)) for x, y in batches(steps, dp)]
    ref_losses, ref_grads, ref_params = _reference(plain, data, dp)
    recs = _trainings(schedule_name, plain, mesh, data, opts, folder)
    mine = stage_indices(mesh["pp"].get_local_rank(), pp, per_rank, style)
    worst = {}
    for system, rec in recs.items():
        w = worst[system] = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        # ours (and ours resumed from FSDP2's checkpoint) against FSDP2's uninterrupted run;
        # ours resumed from its own checkpoint against its own uninterrupted run, exactly.
        peer, peer_tol = {"ours": ("fsdp2", tol), "ours_from_fsdp2": ("fsdp2", tol),
                          "ours_from_ours": ("ours", 0.0)}.get(system, (None, tol))
        vs = f"vs {peer}"
        if peer is not None:
            w.update({f"loss {vs}": 0.0, f"grad {vs}": 0.0, f"param {vs}": 0.0})
        steps_run = [step for step in range(steps) if rec["grads"][step] is not None]
        w["steps"] = len(steps_run)
        for step in steps_run:
            at = f"{schedule_name} step {step}"
            if num_stages - 1 in mine:  # the schedule returns the micro-batch losses on the last stage's ranks
                assert len(rec["losses"][step]) == N_MICRO, f"{system} {at}: losses {rec['losses'][step]}"
                local = torch.tensor(sum(rec["losses"][step]), device=device)
                every = [torch.zeros((), device=device) for _ in range(dp)]
                dist.all_gather(every, local, group=mesh["dp"].get_group())
                total = torch.tensor(sum(t.item() for t in every) / (N_MICRO * dp))
                w["loss"] = max(w["loss"], _compare(system, f"{at}: loss vs plain", total,
                                                    torch.tensor(ref_losses[step]), plain_tol))
                if peer is not None:
                    w[f"loss {vs}"] = max(w[f"loss {vs}"], _compare(
                        system, f"{at}: micro-batch losses {vs}", torch.tensor(rec["losses"][step]),
                        torch.tensor(recs[peer]["losses"][step]), peer_tol))
            assert set(rec["grads"][step]) == {n for n in ref_grads[step] if int(n.split(".")[0]) in mine}
            for name, g in rec["grads"][step].items():
                w["grad"] = max(w["grad"], _compare(system, f"{at}: gradient of '{name}' vs plain", g,
                                                    ref_grads[step][name], plain_tol))
                if peer is not None:
                    w[f"grad {vs}"] = max(w[f"grad {vs}"], _compare(
                        system, f"{at}: gradient of '{name}' {vs}", g, recs[peer]["grads"][step][name], peer_tol))
            if rec["norms"][step] is not None:
                want = torch.stack([g.norm() for n, g in ref_grads[step].items() if n in rec["grads"][step]]).norm()
                w["norm"] = max(w.get("norm", 0.0), _compare(
                    system, f"{at}: gradient norm of the rank's stages vs plain", torch.tensor(rec["norms"][step]),
                    want, plain_tol))
                if peer is not None and recs[peer]["norms"][step] is not None:
                    w[f"norm {vs}"] = max(w.get(f"norm {vs}", 0.0), _compare(
                        system, f"{at}: gradient norm {vs}", torch.tensor(rec["norms"][step]),
                        torch.tensor(recs[peer]["norms"][step]), peer_tol))
        for name, t in rec["params"].items():
            w["param"] = max(w["param"], _compare(system, f"{schedule_name}: '{name}' after {steps} steps vs plain",
                                                  t, ref_params[name], plain_tol))
            if peer is not None:
                w[f"param {vs}"] = max(w[f"param {vs}"], _compare(
                    system, f"{schedule_name}: '{name}' after {steps} steps {vs}", t, recs[peer]["params"][name],
                    peer_tol))
    ours = recs["ours"]
    return {"rank": rank, "stages": mine, "worst": worst, "control": ours["control"],
            "units": ours["units"], "modules": ours["modules"], "tp_params": ours["tp_params"],
            "unit_options": ours["unit_options"], "opts": opts, "buckets": ours["buckets"],
            "compiled": {name: rec["compiled"] for name, rec in recs.items()},
            "controls": {name: rec["control"] for name, rec in recs.items() if name.startswith("ours")}}


def run_name(run: Dict) -> str:
    return run.get("name", run["schedule"])


def pp_parity(rank: int, world: int, runs: List[Dict], steps: int = 3, tol: float = 1e-5,
              folder: Optional[str] = None) -> Dict[str, Dict]:
    """Each run ({"schedule": name, optional "name" (default: the schedule's),
    "reshard_after_forward": bool, "strategy": ours' sharding_strategy, "offload": bool,
    "gather_bucket_bytes" / "reduce_bucket_bytes": ours' buckets, "compile": bool,
    "dcp": the step at which to checkpoint (needs `folder`), "fp8": torchao's FP8 all-gather
    with bf16 parameters, "plain_tol": the tolerance against the plain fp32 model (default
    `tol`)}) in turn on one mesh (HSDP's at world 8 when a run asks for "hsdp"); returns
    {run name: this rank's report}."""
    mesh = make_mesh(world, hsdp=any(run.get("hsdp") for run in runs))
    return {run_name(run): pp_run(rank, world, run["schedule"], mesh, steps, tol, run, folder) for run in runs}


# ---------------------------------------------------------------- checks of the per-rank reports

TOL = 1e-5


def check_parity(reports, schedule: str) -> None:
    for r in reports:
        for system, worst in r["worst"].items():
            for what, err in worst.items():
                if what == "steps":
                    continue
                assert err <= TOL, f"{schedule} rank {r['rank']} {system}: {what} rel err {err:.3e}"


def check_reduced_once_per_step(reports, schedule: str, kind: str = "reduce_scatter", per_unit: int = 1) -> None:
    """Our reductions of each step (`kind`: "reduce_scatter", or "all_reduce": the
    strategies that all-reduce full gradients, HSDP's all-reduce across replicas, and every
    unit's small all-reduce of which parameters got gradients): none before the first
    REDUCE_GRAD (the micro-batch backwards only accumulate), each stage's units
    `per_unit` times inside its REDUCE_GRAD (at least that often for all-reduces; a reduce
    bucket's units, planned by the stage root's budget, in one coalesced reduce-scatter),
    none after. ZeRO-3 leaves no unit gathered after a step; optim_grads and optim leave every
    unit gathered unless the schedule's RESHARD released it."""
    for r in reports:
        keeps = r.get("opts", {}).get("strategy") not in (None, "optim_grads_params")
        for step, c in enumerate(r["control"]):
            at = f"{schedule} rank {r['rank']} step {step}"
            spans = c["reduce_grads"] if kind == "reduce_scatter" else c["all_reduces_in_reduce_grad"]
            total = c["reduce_scatters"] if kind == "reduce_scatter" else c["all_reduces"]
            assert sorted(s for s, _, _ in spans) == sorted(r["stages"]), \
                f"{at}: REDUCE_GRAD per stage {spans}, stages {r['stages']}"
            done, wanted = 0, 0
            for stage, before, during in spans:
                assert before == done, f"{at}: {before - done} {kind}s outside REDUCE_GRAD (stage {stage})"
                want = per_unit * r["units"][stage]
                if kind == "reduce_scatter":  # a reduce bucket's units share one coalesced call
                    plan = r["buckets"][stage]["reduce"]
                    want = per_unit * (len(plan) + r["units"][stage] - sum(len(b) for b in plan))
                assert during == want if kind == "reduce_scatter" else during >= max(want, 1), \
                    f"{at}: stage {stage}: {during} {kind}s for {r['units'][stage]} units ({per_unit} each), " \
                    f"reduce buckets {r['buckets'][stage]['reduce']}"
                done += during
                wanted += want
            assert total == done, f"{at}: {total} {kind}s in all, {done} in REDUCE_GRAD"
            if kind == "reduce_scatter":
                assert total == wanted, f"{at}: {total} {kind}s in all, {wanted} wanted"
            if not keeps:
                assert c["left_gathered"] == [], f"{at}: units still gathered after the step: {c['left_gathered']}"
            elif r["opts"]["strategy"] != "no_shard":  # (no_shard has no gathered copy)
                # optim_grads and optim keep each unit gathered between steps, unless the
                # schedule's RESHARD action (runtime schedules) released it.
                want = [] if r["control"][0]["unshards"] else sorted(o["unit"] for o in r["unit_options"])
                assert sorted(c["left_gathered"]) == want, f"{at}: units gathered after the step: {c['left_gathered']}"


def check_gathered_bytes(reports, schedule: str, expect: str) -> None:
    """What our all-gathers moved in each step after the first (the first also runs the
    stages' metadata inference), against the unsharded bytes of the rank's units (bucket
    plans change the number of calls, not the bytes): "once": each unit gathered once a
    step (ZeRO-2, ZeRO-1: kept gathered from the first forward to REDUCE_GRAD); "none"
    (no_shard); "more": ZeRO-3 gathers again for later micro-batches."""
    for r in reports:
        per_step = sum(o["unsharded_nbytes"] for o in r["unit_options"])
        for step, c in enumerate(r["control"][1:], start=1):
            at = f"{schedule} rank {r['rank']} step {step}: {c['all_gather_bytes']} bytes gathered, units {per_step}"
            if expect == "once":
                assert per_step > 0 and c["all_gather_bytes"] == per_step, at
            elif expect == "none":
                assert c["all_gather_bytes"] == 0 and c["all_gathers"] == 0, at
            else:
                assert c["all_gather_bytes"] > 2 * per_step, at


def check_unit_options(reports, schedule: str, **want) -> None:
    """Every unit of every stage took the options (strategy, reshard_after_forward,
    offloaded, shard_size, replicate_size) and shards over the ranks of its mesh dim
    (dp, or HSDP's dp_shard)."""
    for r in reports:
        assert len(r["unit_options"]) == sum(r["units"].values()) > 0, r["unit_options"]
        for o in r["unit_options"]:
            got = {k: o[k] for k in want}
            assert got == want, f"{schedule} rank {r['rank']} unit {o['unit']}: {got}, expected {want}"
            assert o["shard_ranks"] == o["mesh_shard_ranks"] and len(o["shard_ranks"]) == o["shard_size"], o


def check_unsharded_ahead(reports, schedule: str) -> None:
    """Runtime schedules: each step the schedule's UNSHARD calls unshard(async_op=True) on
    every FSDPModule of each stage once, waits every handle, and each unit is gathered when
    its first forward of the step starts. (Step 0 is left out of the last check: the stage's
    metadata inference runs a forward before the schedule's first action.)"""
    for r in reports:
        for step, c in enumerate(r["control"]):
            at = f"{schedule} rank {r['rank']} step {step}"
            assert sorted(k for k, _ in c["unshards"]) == r["modules"], f"{at}: unshard calls {c['unshards']}"
            assert all(async_op for _, async_op in c["unshards"]), f"{at}: unshard calls {c['unshards']}"
            assert c["waits"] == len(c["unshards"]), f"{at}: {c['waits']} waits for {len(c['unshards'])} unshards"
            if step > 0:
                assert c["gathered_at_first_forward"] == {k: True for k in r["modules"]}, \
                    f"{at}: gathered when their first forward started: {c['gathered_at_first_forward']}"
