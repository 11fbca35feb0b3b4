"""Workers for tests/distributed/test_feature_pairs_fp8.py: torchao's FP8 all-gather
(Float8LinearConfig(enable_fsdp_float8_all_gather=True)) paired with HSDP and with DCP
checkpoints. FP8 training is not fp32's, so the reference is FSDP2 + torchao's own FP8
gather under the same mesh and policy (bf16 parameters, fp32 reduction), as in
fp8_workers.py: losses, every step's full gradients, the parameters after."""
from __future__ import annotations

import os
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.param_index import iter_states

from .fp8_workers import D_IN, D_OUT, ROWS, _float8_gathered, _train_against_fsdp2, amax_scale
from .funcol_c10d import route_functional_collectives_through_c10d
from .tp_workers import worst_against_fsdp2
from .workers import device_for_backend, rel_err

MP = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(world: int):
    return init_device_mesh(device_for_backend().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _shard_ours(model: nn.Module, mesh=None, strategy: str = "optim_grads_params") -> nn.Module:
    mp = mfsdp.MixedPrecisionPolicy(**MP)
    kw = dict(mp_policy=mp, sharding_strategy=strategy)
    if mesh is not None:
        kw["mesh"] = mesh
    for unit in (model.up, model.mid):
        mfsdp.fully_shard(unit, **kw)
    return mfsdp.fully_shard(model, **kw)


def _shard_fsdp2(model: nn.Module, mesh=None) -> nn.Module:
    """FSDP2 (torch's fully_shard) on the same units and mesh, sums on Gloo (no average in
    its reduce-scatter; FSDP2 divides after)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mp_policy=MixedPrecisionPolicy(**MP))
    if mesh is not None:
        kw["mesh"] = mesh
    for unit in (model.up, model.mid):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    if dist.get_backend() == "gloo":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _assert_fp8_units(model: nn.Module, shard: int, replicate: int) -> None:
    """Every unit gathers its weights in FP8 (biases in bf16) over `shard` ranks and
    holds `replicate` replicas."""
    units = [s.unit for s in iter_states(model) if s.unit is not None]
    assert len(units) == 3, units
    for u in units:
        assert u.gathers_bytes and u.world_size == shard and u.replicate_size == replicate, \
            (u.label, u.gathers_bytes, u.world_size, u.replicate_size)
        kinds = {s.name.rsplit(".", 1)[-1]: str(s.transform) for s in u.param_specs}
        assert all(("FP8" in k) == (n == "weight") for n, k in kinds.items()), kinds


def _scales_are_torchaos(model: nn.Module, what: str) -> None:
    """Each FP8 weight's scale is torchao's for its full fp32 master (the amax over every
    shard of the shard group), on every rank."""
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for prefix, m in (("up.", model.up), ("mid.", model.mid), ("", model)):
        unit = m._fsdp_state.unit
        for i, spec in enumerate(unit.param_specs):
            if spec.name.endswith("weight"):
                want = amax_scale(full[prefix + spec.name])
                assert torch.equal(unit.fp8_scales[i].cpu(), want), \
                    f"{what}: scale of {prefix + spec.name} {unit.fp8_scales[i].item()} vs torchao's {want.item()}"


def hsdp_fp8_vs_fsdp2(rank: int, world: int, strategies: List[str], steps: int = 3) -> Dict:
    """HSDP on a (replicate 2, shard world/2) mesh with the FP8 gather against FSDP2 +
    torchao's FP8 gather on the same mesh: losses and full gradients every step, values
    after (the replicas must agree: full_of_ours checks them). The units gather FP8 bytes
    over the shard dim only and all-reduce gradients over the replicate dim."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":
        route_functional_collectives_through_c10d()
    mesh = _mesh(world)
    report = {}
    for strategy in strategies:
        ours = _shard_ours(_float8_gathered(), mesh, strategy)
        theirs = _shard_fsdp2(_float8_gathered(), mesh)
        _assert_fp8_units(ours, world // 2, 2)
        seen = []
        hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(type(mod.weight)))
                 for m in (ours.up, ours.mid, ours.out)]
        _C.reset_collective_counts()
        worst = _train_against_fsdp2(ours, theirs, rank, world, steps, f"HSDP x FP8 gather ({strategy})",
                                     after_step=lambda: precompute_float8_dynamic_scale_for_fsdp(theirs))
        counts = _C.collective_counts()
        for h in hooks:
            h.remove()
        assert seen and all(t is Float8TrainingTensor for t in seen), seen
        # Gradients reach the other replica: one all-reduce per unit and step at least.
        assert counts["all_reduce"][0] >= 3 * steps, counts
        _scales_are_torchaos(ours, f"HSDP ({strategy}), after {steps} steps")
        report[strategy] = worst
    return report


def _save(model: nn.Module, opt, path: str) -> None:
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def _load(model: nn.Module, opt, path: str) -> None:
    """torch's state-dict helpers and DCP, as a training script resumes (any system)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _worst(model, fsdp2, which: str, placements, what: str, tol: float = 1e-6) -> float:
    """The largest relative error of `model`'s full gradients (or values), ours or FSDP2's,
    against FSDP2's uninterrupted run, each asserted <= tol."""
    if any(getattr(p, "_mfsdp_owner", None) is not None for p in model.parameters()):
        return worst_against_fsdp2(model, fsdp2, which, placements, None, tol, what)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), fsdp2.parameters()):
        a, b = ((t.grad if which == "grad" else t).full_tensor() for t in (p, q))
        e = rel_err(a, b)
        assert e <= tol, f"{what}: {which} of '{name}' rel err {e:.3e} against FSDP2's"
        worst = max(worst, e)
    return worst


def fp8_dcp_resume(rank: int, world: int, folder: str, steps: int = 4, resume_at: int = 2) -> Dict:
    """The FP8 gather through DCP checkpoints. Ours and FSDP2 + torchao (both FP8 gather)
    train side by side; at `resume_at` each saves model and AdamW state, and these resume
    into fresh models built from another seed:
      - ours from our checkpoint: continues bit for bit as our uninterrupted run;
      - FSDP2 + torchao from our checkpoint, and ours from FSDP2's: continue as FSDP2's
        uninterrupted run (losses, full gradients every step, values after);
      - a plain fp32 module (no torchao, not sharded) loads our checkpoint: our values.
    The resumed units gather FP8 again, with scales taken from the loaded values."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from .fp8_workers import MLP
    from .tp_workers import full_of_ours, placements_of

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":
        route_functional_collectives_through_c10d()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(world * ROWS, D_IN, generator=g), torch.randn(world * ROWS, D_OUT, generator=g))
            for _ in range(steps)]
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    runs = {"ours": _shard_ours(_float8_gathered()), "fsdp2": _shard_fsdp2(_float8_gathered())}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in runs.items()}
    placements = placements_of(runs["ours"])
    _assert_fp8_units(runs["ours"], world, 1)
    seen = []

    def watch(model):
        for m in (model.up, model.mid, model.out):
            m.register_forward_pre_hook(lambda mod, args: seen.append(type(mod.weight)))
    watch(runs["ours"])
    report = {"loss": 0.0, "grad": 0.0}
    for step, (x, y) in enumerate(data):
        if step == resume_at:
            for k in ("ours", "fsdp2"):
                _save(runs[k], opts[k], os.path.join(folder, k))
            for k, build, src in (("ours_resumed", _shard_ours, "ours"), ("fsdp2_from_ours", _shard_fsdp2, "ours"),
                                  ("ours_from_fsdp2", _shard_ours, "fsdp2")):
                runs[k] = build(_float8_gathered(seed=5))
                opts[k] = torch.optim.AdamW(runs[k].parameters(), lr=1e-2)
                _load(runs[k], opts[k], os.path.join(folder, src))
            for k in ("ours_resumed", "ours_from_fsdp2"):
                _assert_fp8_units(runs[k], world, 1)
                watch(runs[k])
            sd = get_model_state_dict(runs["ours"])
            assert all(v.dtype == torch.float32 for v in sd.values()), {k: v.dtype for k, v in sd.items()}
            # A plain fp32 module (no torchao, not sharded) loads our checkpoint.
            torch.manual_seed(5)
            plain = MLP().to(device)
            plain_sd = plain.state_dict()
            dcp.load({"model": plain_sd}, checkpoint_id=os.path.join(folder, "ours"))
            saved = mfsdp.full_state_dict(runs["ours"], rank0_only=False)
            assert set(plain_sd) == set(saved), (sorted(plain_sd), sorted(saved))
            for name, v in saved.items():
                assert torch.equal(plain_sd[name], v), f"a plain module loaded '{name}' differently"
        losses, grads = {}, {}
        for k, m in runs.items():
            loss = F.mse_loss(m(x[mine].to(device)).float(), y[mine].to(device))
            loss.backward()
            losses[k] = loss.item()
        for k, m in runs.items():
            if k.startswith("ours"):
                grads[k] = full_of_ours(m, "grad", placements)
        if step == resume_at:  # the scales the resumed units gathered with: torchao's of the loaded values
            for k in ("ours_resumed", "ours_from_fsdp2"):
                _scales_are_torchaos(runs[k], f"{k}, first step after the resume")
        if "ours_resumed" in runs:
            assert losses["ours_resumed"] == losses["ours"], f"step {step}: resumed loss {losses}"
            for name, v in grads["ours"].items():
                assert torch.equal(grads["ours_resumed"][name], v), f"step {step}: resumed gradient of '{name}'"
        for k in runs:
            if k == "fsdp2":
                continue
            err = abs(losses[k] - losses["fsdp2"]) / abs(losses["fsdp2"])
            assert err <= 1e-6, f"step {step}, {k}: loss {losses[k]} vs FSDP2's {losses['fsdp2']}"
            report["loss"] = max(report["loss"], err)
            report["grad"] = max(report["grad"], _worst(runs[k], runs["fsdp2"], "grad", placements, f"step {step}, {k}"))
        for k in runs:
            opts[k].step()
            opts[k].zero_grad()
            if k.startswith("fsdp2"):
                precompute_float8_dynamic_scale_for_fsdp(runs[k])
    for k in runs:
        if k != "fsdp2":
            _worst(runs[k], runs["fsdp2"], "value", placements, f"{k}, after the steps")
    ours_final, resumed = (full_of_ours(runs[k], "value", placements) for k in ("ours", "ours_resumed"))
    for name, v in ours_final.items():
        assert torch.equal(resumed[name], v), f"resumed value of '{name}' differs from the uninterrupted run's"
    assert seen and all(t is Float8TrainingTensor for t in seen), set(seen)
    return report


# ------------------------------------------------------------------ MoE x FP8 gather

MOE_DIM, MOE_HIDDEN, MOE_EXPERTS = 64, 32, 4  # FP8 matmuls want dims divisible by 16


class _Experts(nn.Module):
    """Grouped experts ([local experts, ...] weights, bmm's), every expert seeing the tokens."""

    def __init__(self, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, MOE_HIDDEN, MOE_DIM) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, MOE_DIM, MOE_HIDDEN) * 0.1)

    def forward(self, x):
        return torch.bmm(F.relu(torch.bmm(x, self.w1.transpose(1, 2))), self.w2.transpose(1, 2))


class _MoEBlock(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.dense = nn.Linear(MOE_DIM, MOE_DIM)
        self.experts = _Experts(experts)

    def forward(self, x):
        y = torch.tanh(self.dense(x))
        return y + self.experts(y.unsqueeze(0).expand(self.experts.w1.shape[0], -1, -1)).mean(0)


class _MoENet(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock(experts) for _ in range(2))
        self.head = nn.Linear(MOE_DIM, MOE_DIM)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _moe_fp8(impl: str, world: int, ep: int) -> nn.Module:
    """This ep rank's slice of one seeded model (experts plain per ep rank, Megatron-Core's
    form), the blocks' dense Linears converted with torchao's FP8 all-gather, sharded with
    the experts on the expert data-parallel mesh (FSDP2's ShardPlacementResult) and the
    rest over the dp mesh, bf16 parameters and fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from .moe_unit_workers import PlacementResult, mesh_info, meshes

    torch.manual_seed(0)
    whole = _MoENet(MOE_EXPERTS).state_dict()
    dense_mesh, sparse, expert_dp_mesh = meshes(world, ep, 1)
    local = MOE_EXPERTS // ep
    first = sparse["ep"].get_local_rank() * local
    model = _MoENet(local)
    model.load_state_dict({k: v[first:first + local] if ".experts." in k else v for k, v in whole.items()})
    model = convert_to_float8_training(model.to(device_for_backend()),
                                       config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                       module_filter_fn=lambda m, fqn: fqn.endswith(".dense"))
    if impl == "fsdp2":
        shard, mp = fully_shard, MixedPrecisionPolicy(**MP)
    else:
        shard, mp = mfsdp.fully_shard, mfsdp.MixedPrecisionPolicy(**MP)
    for b in model.blocks:
        experts, expert_info, dense_info = set(b.experts.parameters()), mesh_info(expert_dp_mesh), mesh_info(dense_mesh)
        shard(b, mesh=dense_mesh, mp_policy=mp, shard_placement_fn=lambda p, e=experts, ei=expert_info, di=dense_info:
              PlacementResult(Shard(0), ei if p in e else di))
    shard(model, mesh=dense_mesh, mp_policy=mp)
    if impl == "fsdp2" and dist.get_backend() == "gloo":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def moe_fp8_gather_vs_fsdp2(rank: int, world: int, ep: int = 2, steps: int = 3, lr: float = 0.5) -> Dict:
    """MoE blocks (experts on the expert mesh) whose dense Linears gather FP8, against
    FSDP2 + torchao under the same placement: per step the global loss and each
    parameter's full gradient (SGD: (before - after) / lr; the experts: this ep rank's),
    the values after. Our dense units gather their weight in FP8 and the expert units
    stay bf16, each over its own group."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from .moe_unit_workers import _full

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":
        route_functional_collectives_through_c10d()
    models = {impl: _moe_fp8(impl, world, ep) for impl in ("fsdp2", "ours")}
    for b in models["ours"].blocks:
        dense, experts = b._fsdp_state.unit, b._fsdp_state.companions[0].unit
        kinds = {s.name: str(s.transform) for s in dense.param_specs}
        assert kinds == {"dense.weight": "GatherTransform.FP8", "dense.bias": "GatherTransform.CAST"}, kinds
        assert all("FP8" not in str(s.transform) for s in experts.param_specs), experts.param_specs
        assert (dense.world_size, experts.world_size) == (world, world // ep), (dense.world_size, experts.world_size)
    opts = {impl: torch.optim.SGD(m.parameters(), lr=lr) for impl, m in models.items()}
    gen = torch.Generator().manual_seed(7 + rank)
    worst = {"loss": 0.0, "grad": 0.0, "value": 0.0}
    start = _full(models["ours"])
    for _ in range(steps):
        x = torch.randn(ROWS, MOE_DIM, generator=gen).to(device)
        before = {impl: _full(m) for impl, m in models.items()}
        losses = {}
        for impl, m in models.items():
            loss = m(x).float().square().mean()
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses[impl] = total.item()
            opts[impl].step()
            opts[impl].zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(models["fsdp2"])
        after = {impl: _full(m) for impl, m in models.items()}
        worst["loss"] = max(worst["loss"], abs(losses["ours"] - losses["fsdp2"]) / abs(losses["fsdp2"]))
        for k, v in before["fsdp2"].items():
            grad = {impl: (before[impl][k] - after[impl][k]) / lr for impl in models}
            worst["grad"] = max(worst["grad"], rel_err(grad["ours"], grad["fsdp2"]))
    final = {impl: _full(m) for impl, m in models.items()}
    worst["value"] = max(rel_err(final["ours"][k], v) for k, v in final["fsdp2"].items())
    worst["moved"] = max(rel_err(final["ours"][k], v) for k, v in start.items())
    return worst
