"""Mixture-of-experts units (experts on the expert data-parallel mesh through FSDP2's
ShardPlacementResult, as torchtitan 0.3.0's apply_fsdp_to_decoder passes it) combined with
the other features of the README's matrix: ZeRO-2 (reshard_after_forward=False on the
blocks), CPU offload (offload_policy=CPUOffloadPolicy()), torch.compile of the blocks, and
our own options FSDP2 lacks: gather and reduce buckets (one budget for every unit on the
root), ZeRO-1 and no shard on the blocks and the root (against one plain process only).

The model and meshes are moe_unit_workers' (a dense Linear and grouped experts per block,
ep 2 at world 4: dense parameters over the 4-rank "fsdp" mesh, experts over the 2-rank
"efsdp" mesh). The same script runs under torch's fully_shard (the reference) and ours;
per step the loss, the global gradient norm and the full gradients (SGD: (before - after) /
lr, a wrong scale shows at once), split into expert and dense parameters, and the values
after the last step are compared. Each run also records, from both systems' own state,
that the option reached the dense unit and the expert unit of every block.

Two forms of experts:
- "dtensor": expert weights DTensors Shard(0) on the "ep" mesh (torchtitan's form);
- "plain": each ep rank holds its experts as plain parameters (a slice of the one seeded
  model, Megatron-Core's form), placed on the "efsdp" mesh by the same shard_placement_fn.
  CPU offload of units holding DTensor parameters is refused by name (construct.py;
  moe_unit_workers.moe_placement_refusals), so offload is trained in this form.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import megatron_fsdp_ext as mfsdp

from .moe_unit_workers import (DIM, EXPERTS, TOKENS, GroupedExperts, MoEModel, PlacementResult, _full, mesh_info,
                               meshes, one_process, sgd_steps)
from .workers import device_for_backend, rel_err


class LeanExperts(GroupedExperts):
    """GroupedExperts' computation without its layout record (storage pointers, which
    Dynamo cannot trace): the same bmm's on the local experts."""

    def forward(self, x, first_expert: int = 0):
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        return torch.bmm(torch.relu(torch.bmm(x, w1.transpose(1, 2))), w2.transpose(1, 2))


class RecordingBackend:
    """aot_eager, keeping the call_function targets of every graph Dynamo hands over."""

    def __init__(self):
        self.graphs: List[List[str]] = []
        self.calls: List[int] = []  # per graph: how many forwards ran it

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        index = len(self.graphs)
        self.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        self.calls.append(0)
        compiled = aot_eager(gm, example_inputs)

        def counted(*args):
            self.calls[index] += 1
            return compiled(*args)

        return counted


# One bucket for every unit that may join one (ours only: FSDP2 has no buckets).
ONE_BUCKET = 1 << 30
STRATEGIES = {"zero1": "optim", "no_shard": "no_shard"}


def _kwargs(feature: str, impl: str = "fsdp2"):
    """(block kwargs, root kwargs) of fully_shard for `feature`; the same for both systems
    except for our own options (buckets, ZeRO-1 and no shard, which FSDP2 lacks)."""
    if feature == "zero2":
        return {"reshard_after_forward": False}, {}
    if feature == "buckets":
        buckets = {"gather_bucket_bytes": ONE_BUCKET, "reduce_bucket_bytes": ONE_BUCKET} if impl == "ours" else {}
        return {}, buckets
    if feature in STRATEGIES:
        if impl != "ours":
            raise ValueError(f"FSDP2 has no {feature}: compare it with one plain process")
        strategy = {"sharding_strategy": STRATEGIES[feature]}
        return strategy, strategy
    if feature == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
        return policy, policy
    if feature == "compile":
        return {}, {}
    raise ValueError(feature)


def build(impl: str, world: int, ep: int, factor: Optional[float], form: str, feature: str):
    """The model sharded as torchtitan shards it for `ep` (moe_unit_workers.build), with
    `feature`'s fully_shard arguments on the blocks (and the root for offload)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(0)
    model = MoEModel().to(device_for_backend())
    dense_mesh, sparse, expert_dp_mesh = meshes(world, ep, 1)
    ep_rank, local = sparse["ep"].get_local_rank(), EXPERTS // ep
    for b in model.blocks:
        b.experts.__class__ = LeanExperts
        for name in ("w1", "w2"):
            value = getattr(b.experts, name).detach()
            if form == "dtensor":
                value = distribute_tensor(value, sparse["ep"], [Shard(0)])
            else:  # this ep rank's experts, plain
                value = value[ep_rank * local:(ep_rank + 1) * local].clone()
            setattr(b.experts, name, nn.Parameter(value))
    shard = fsdp2_fully_shard if impl == "fsdp2" else mfsdp.fully_shard
    block_kw, root_kw = _kwargs(feature, impl)
    for b in model.blocks:
        experts = set(b.experts.parameters())
        expert_info, dense_info = mesh_info(expert_dp_mesh), mesh_info(dense_mesh)

        def placement(p, experts=experts, expert_info=expert_info, dense_info=dense_info):
            return PlacementResult(Shard(0), expert_info if p in experts else dense_info)

        shard(b, mesh=dense_mesh, shard_placement_fn=placement, **block_kw)
    shard(model, mesh=dense_mesh, **root_kw)
    for m in model.modules():
        if factor is not None and hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(factor)
        if impl == "fsdp2" and hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM / AVG
    return model, ep_rank * local, local


def _expert_keys(model) -> set:
    return {k for k in model.state_dict() if ".experts." in k}


# ------------------------------------------------------------------ what each system says


def _fsdp2_groups(block):
    """FSDP2's param groups of a block, the dense one (fsdp mesh) and the expert one."""
    groups = block._get_fsdp_state()._fsdp_param_groups
    by_mesh = {}
    for g in groups:
        names = tuple(g.mesh_info.mesh.mesh_dim_names or ())
        by_mesh[names] = g
    return by_mesh


def _ours_states(block):
    """Our unit states of a block, by mesh: the leader (fsdp mesh) and its companion (efsdp)."""
    state = block._fsdp_state
    assert len(state.companions) == 1, f"{len(state.companions)} companion units, not one expert unit"
    return {"dense": state, "experts": state.companions[0]}


def after_forward(impl: str, model) -> List[Dict[str, bool]]:
    """Per block, between forward and backward: is each of its units (dense, experts)
    still unsharded (ZeRO-2 keeps both gathered; ZeRO-3 reshards both)."""
    out = []
    for b in model.blocks:
        if impl == "fsdp2":
            groups = _fsdp2_groups(b)
            assert len(groups) == 2, f"FSDP2 block param groups on meshes {list(groups)}"
            out.append({"dense" if names == ("fsdp",) else "experts": g.is_unsharded for names, g in groups.items()})
        else:
            out.append({k: s.unit.state != s.unit.state.SHARDED for k, s in _ours_states(b).items()})
    return out


def option_on_units(impl: str, model, feature: str) -> List[Dict[str, object]]:
    """Per block, the option as each unit (dense, experts) holds it."""
    out = []
    for b in model.blocks:
        if impl == "fsdp2":
            from torch.distributed.fsdp import CPUOffloadPolicy

            groups = _fsdp2_groups(b)
            row = {}
            for names, g in groups.items():
                key = "dense" if names == ("fsdp",) else "experts"
                if feature == "offload":
                    row[key] = isinstance(g.offload_policy, CPUOffloadPolicy) and all(
                        p._sharded_local_tensor.device.type == "cpu" for p in g.fsdp_params)
                else:
                    row[key] = g.post_forward_mesh_info is not None  # reshards after forward
            out.append(row)
        else:
            row = {}
            for k, s in _ours_states(b).items():
                if feature == "offload":
                    row[k] = bool(s.unit.offloaded) and s.unit.sharded_flat.device.type == "cpu"
                elif feature in STRATEGIES:  # the unit's strategy, whose gradients are whole on every rank
                    row[k] = s.unit.strategy.megatron_name == STRATEGIES[feature] and s.unit.strategy.full_grads
                else:
                    row[k] = s.reshard_after_forward
            out.append(row)
    return out


# ------------------------------------------------------------------ training


def run(impl: str, rank: int, world: int, ep: int, factor: Optional[float], form: str, feature: str,
        steps: int, lr: float = 0.5) -> Dict:
    """SGD training recording losses, global norms, each step's full gradients and the
    units' state between forward and backward."""
    torch._dynamo.reset()
    model, first_expert, local_experts = build(impl, world, ep, factor, form, feature)
    backend = None
    if feature == "compile":
        backend = RecordingBackend()
        for b in model.blocks:
            b.compile(backend=backend, fullgraph=True)
    unsharded = []
    start = _full(model)
    losses, norms, grads = sgd_steps(model, impl, first_expert, local_experts, rank, world, steps, lr,
                                     after_forward=lambda m: unsharded.append(after_forward(impl, m)))
    params = _full(model)
    graphs = (list(backend.graphs), list(backend.calls)) if backend else ([], [])  # the compared steps'
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "model": model,
            "collectives": _collectives_of_a_step(model, first_expert, local_experts, rank),
            "budgets": model.bucket_budgets() if impl == "ours" else None,
            "unsharded": unsharded, "option": option_on_units(impl, model, feature),
            "graphs": graphs, "experts": _expert_keys(model), "start": start}


def _collectives_of_a_step(model, first_expert: int, local_experts: int, rank: int) -> Dict[str, int]:
    """The process group's all-gather and reduce-scatter calls in one more forward and
    backward (after the compared steps; its gradients are dropped), as c10d dispatches
    them: a bucket's coalesced collective counts once."""
    from .observe import count_collectives

    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(999 + rank)).to(device_for_backend())
    with count_collectives() as counts:
        model(x, first_expert, local_experts).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return {kind: sum(n for op, n in counts.items() if op.startswith(f"c10d::{kind}"))
            for kind in ("_allgather_base", "allgather", "_reduce_scatter_base", "reduce_scatter")}


def _worst(ours: Dict, ref: Dict) -> Dict[str, float]:
    """The largest relative difference of each step's loss, global norm, full expert and
    dense gradients, and of the expert and dense values after the last step."""
    worst = {"loss": 0.0, "norm": 0.0, "grad_experts": 0.0, "grad_dense": 0.0, "param_experts": 0.0,
             "param_dense": 0.0}
    experts = ref["experts"]
    for step, ref_grads in enumerate(ref["grads"]):
        worst["loss"] = max(worst["loss"], abs(ours["losses"][step] - ref["losses"][step]) / ref["losses"][step])
        worst["norm"] = max(worst["norm"], abs(ours["norms"][step] - ref["norms"][step]) / ref["norms"][step])
        for k, g in ref_grads.items():
            key = "grad_experts" if k in experts else "grad_dense"
            worst[key] = max(worst[key], rel_err(ours["grads"][step][k], g))
    for k, v in ref["params"].items():
        key = "param_experts" if k in experts else "param_dense"
        worst[key] = max(worst[key], rel_err(ours["params"][k], v))
    return worst


def _moved(run_: Dict) -> float:
    return max(rel_err(run_["params"][k], v) for k, v in run_["start"].items())


def moe_feature_vs_fsdp2(rank: int, world: int, configs: List[Dict], steps: int = 3) -> Dict[str, Dict]:
    """Each config ({"name", "feature", "form", "ep", "factor", "one_process"}) trained
    under FSDP2 and ours (and, with one_process, in one plain process holding every expert:
    moe_unit_workers.one_process, DTensor form only); returns per config the worst
    differences and what each system's units said."""
    results = {}
    for cfg in configs:
        args = (world, cfg["ep"], cfg.get("factor", 1.0), cfg.get("form", "dtensor"), cfg["feature"], steps)
        ours = run("ours", rank, *args)
        out = {"moved": _moved(ours), "budgets": ours["budgets"], "option": {"ours": ours["option"]},
               "collectives": {"ours": ours["collectives"]}}
        if cfg.get("fsdp2", True):  # FSDP2 has the feature: the same script under it
            theirs = run("fsdp2", rank, *args)
            out.update({"worst": _worst(ours, theirs),
                        "unsharded": {"fsdp2": theirs["unsharded"], "ours": ours["unsharded"]},
                        "graphs": {"fsdp2": theirs["graphs"], "ours": ours["graphs"]},
                        "placements_equal": _placements(ours["model"]) == _placements(theirs["model"])})
            out["option"]["fsdp2"] = theirs["option"]
            out["collectives"]["fsdp2"] = theirs["collectives"]
        if cfg.get("one_process"):
            ref = one_process(world, cfg["ep"], cfg.get("factor", 1.0), steps)
            ref["experts"] = ours["experts"]
            out["worst_one_process"] = _worst(ours, ref)
        results[cfg["name"]] = out
    return results


def _placements(model) -> Dict[str, tuple]:
    return {k: (tuple(v.device_mesh.mesh_dim_names or ()), tuple(v.placements))
            for k, v in model.state_dict().items() if isinstance(v, DTensor)}
