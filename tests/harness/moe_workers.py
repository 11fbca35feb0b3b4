"""torchtitan 0.3.0's mixture-of-experts models under its own parallelize code, FSDP2 and
ours side by side (the `fully_shard` swap of titan_workers, the only change).

DeepSeek-V3 "debugmodel" (layer 0 dense, the others MoE: 8 experts, top-3, shared
experts) and Qwen3 "debugmodel_moe" (64 experts, top-8; cut to 2 layers), fp32, SDPA
attention (flex has no CPU backward), optionally with every `num_experts` of the config
set to another value (2: more expert-FSDP ranks than experts, so torchtitan shards the
experts on dim 1). torchtitan's parallelize_deepseekv3 / parallelize_qwen3 with
ParallelDims(dp_replicate, dp_shard=world//(dp_replicate*tp), tp=tp, ep=ep, spmd_backend=
"partial_dtensor"): with tp > 1 the dense weights are DTensors on the "tp" mesh
(torchtitan's TP plan, sequence parallel; efsdp = dp_shard * tp / ep), with ep > 1 the expert weights are DTensors Shard(0) on the "ep" mesh
and apply_fsdp_to_decoder shards each MoE block with a `shard_placement_fn` returning
torch's ShardPlacementResult (experts on the "efsdp" mesh, the rest on the dp mesh);
with ep == 1 it is a plain fully_shard(block) (experts Shard(0)) or one with
shard_placement_fn -> Shard(1) (fewer experts than dp ranks).

Both models start from the same weights (the reference's state dict loaded into a copy of
it before either is parallelized) and train on the same data: torch AdamW, loss
cross entropy over each data-parallel rank's rows of a fixed random batch, divided by the
dp world (torchtitan's disable_fsdp_gradient_division makes the reduced gradients sums).

FSDP2 on Gloo: torchtitan's divide factor 1.0 makes FSDP2 reduce with PREMUL_SUM(1.0),
which Gloo refuses; set_force_sum_reduction_for_comms(True) on every FSDP2 module gives
the same sums (as titan_workers does).

Full values and gradients: each rank compares its piece of the second model against the
same elements of FSDP2's full tensor (.full_tensor() of its DTensors, on every rank);
ours' pieces are its 1-D shard pieces (`_ours_piece`: the harness' shard_piece gives the
piece's offset in the parameter's local tensor, which for an expert weight under EP is this
ep rank's Shard(0) block of experts, for a dense weight under TP this tp rank's Shard(d)
block, read off FSDP2's placements on the "tp" / "ep" mesh dims; a block cut on dim d > 0
makes the piece strided in the full tensor), and their spans must cover every parameter.
Only squared sums and spans move. The grad norm each side reports is checked at the last step against
the float64 norm of its own full gradients.

The routed experts compute in fp32 in both models by default (use_fp32_experts: torchtitan
casts them to bfloat16, which turns last-bit differences into ~1e-4 ones after one step).
"""
from __future__ import annotations

import copy
import dataclasses
import time
import types
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .titan_workers import _batches, _fully_shard_in_torchtitan, _loss, install_trainer_stubs
from .tp_workers import plain_name
from .workers import device_for_backend, shard_piece

EXPERT_W1 = "layers.1.moe.routed_experts.inner_experts.w1_EFD"
_FLAVORS = {"dsv3": ("deepseek_v3", "debugmodel"), "qwen3": ("qwen3", "debugmodel_moe")}
# Layers and routed experts kept of each flavor (None: the flavor's own). DeepSeek-V3's
# debugmodel: its dense first layer and two MoE layers of its five identical ones (two
# expert units, so one prefetches the next); Qwen3's: 2 layers, 32 of its 64 experts
# (16 local experts at ep 2, still Shard(0) over efsdp). What is left out repeats what is
# kept: it cost CPU test time, not code paths. (With 16 experts the runs drift apart:
# 1.1e-4 on the embedding after 10 steps; with 32, 7e-6 as with 64.)
_DEFAULT_LAYERS = {"dsv3": 3, "qwen3": 2}
_DEFAULT_EXPERTS = {"dsv3": None, "qwen3": 32}


def _set_num_experts(cfg, num_experts: int) -> None:
    """Every `num_experts` field of the model config (MoE, router, GroupedExperts, token
    dispatcher) and the router gate's out_features set to `num_experts`; top_k capped."""
    seen = set()

    def walk(o):
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
            return
        if not dataclasses.is_dataclass(o):
            return
        for f in dataclasses.fields(o):
            if f.name == "num_experts":
                setattr(o, f.name, num_experts)
                if hasattr(o, "gate"):
                    o.gate.out_features = num_experts
            elif f.name == "top_k":
                setattr(o, f.name, min(getattr(o, f.name), num_experts))
            else:
                walk(getattr(o, f.name))

    walk(cfg)


def _moe_spec(model: str, num_experts: Optional[int], layers: Optional[int], parallelism):
    """torchtitan's ModelSpec of the MoE debug model, its config prepared for the CPU."""
    import importlib

    from torchtitan.models.common.attention import ScaledDotProductAttention

    package, flavor = _FLAVORS[model]
    spec = importlib.import_module(f"torchtitan.models.{package}").model_registry(flavor)
    cfg = spec.model
    layers = _DEFAULT_LAYERS[model] if layers is None else layers
    if layers is not None:
        cfg.layers = cfg.layers[:layers]
    num_experts = _DEFAULT_EXPERTS[model] if num_experts is None else num_experts
    if num_experts:
        _set_num_experts(cfg, num_experts)
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # The sharding configs (enable_ep = expert_parallel_degree > 1), before build().
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return spec


def _build(spec):
    torch.manual_seed(0)
    m = spec.model.build()
    m.init_states(buffer_device=torch.device("cpu"))
    return m.to(device_for_backend())


def _grouped_experts_forward_fp32(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3.0's GroupedExperts.forward (partial_dtensor path) computing in the
    input's dtype instead of casting to bfloat16: the same grouped matmuls, in fp32 here."""
    w1, w2, w3 = self.w1_EFD, self.w2_EDF, self.w3_EFD
    if isinstance(w1, DTensor):
        w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    dtype = x_RD.dtype
    h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.to(dtype).transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.to(dtype).transpose(-2, -1), offs=offsets_E)
    return self._grouped_mm(A=h_RF, B_t=w2.to(dtype).transpose(-2, -1), offs=offsets_E)


def use_fp32_experts() -> None:
    """torchtitan's routed experts compute in bfloat16 whatever the parameters' dtype
    (GroupedExperts.forward casts input and weights): weights that differ in the last fp32
    bit (two implementations' sums in another order, then an AdamW step) round to
    different bfloat16 values here and there, and after one step the two models' gradients
    differ by ~1e-4..1e-3 relative (measured: 3.5e-4 at step 2 on dsv3, FSDP2 vs ours). For
    comparisons at fp32 tolerances, both models' experts compute in fp32 instead (this
    process only; each rank is a process of its own)."""
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = _grouped_experts_forward_fp32


def _fsdp2_modules(model):
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return [m for m in model.modules() if isinstance(m, TorchFSDPModule)]


def _describe(t) -> Tuple:
    """(mesh dim names, placements) of a state-dict entry, as comparable strings."""
    if isinstance(t, DTensor):
        return tuple(t.device_mesh.mesh_dim_names or ()), tuple(str(p) for p in t.placements)
    return ("plain",), (str(tuple(t.shape)),)


# ------------------------------------------------------------------ full values and gradients

MODEL_PARALLEL_DIMS = ("tp", "ep")  # mesh dims whose shards are our units' local tensors


def _model_parallel_layouts(fsdp2_model) -> Dict[str, Tuple[Tuple[int, int, int], ...]]:
    """Each parameter's model-parallel layout on this rank, read off FSDP2's DTensors:
    ((mesh dim size, this rank's coordinate, tensor dim), ...) for every Shard placement on
    a "tp" or "ep" mesh dim (the data-parallel dims fsdp / efsdp / dp_replicate left out).
    Our unit of that parameter holds the same block as its local tensor: a dense weight
    under TP the tp rank's Shard(d) block (a Replicate one the whole parameter, on each tp
    rank), an expert weight under EP the ep rank's Shard(0) block of experts."""
    from torch.distributed.tensor import Shard

    out = {}
    for n, p in fsdp2_model.named_parameters():
        layout = []
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for i, (dim_name, placement) in enumerate(zip(names, p.placements)):
                if dim_name in MODEL_PARALLEL_DIMS and isinstance(placement, Shard):
                    layout.append((p.device_mesh.size(i), p.device_mesh.get_local_rank(i), placement.dim))
        assert len(layout) <= 1, f"'{n}': sharded on several model-parallel dims {layout}"
        out[plain_name(n)] = tuple(layout)
    return out


def _local_block(shape: torch.Size, layout) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(shape, origin in the full parameter) of this rank's local block (`layout` as
    _model_parallel_layouts gives it): each (size, coord, dim) keeps chunk `coord` of
    `size` equal chunks of dim `dim`, as Tensor.chunk would."""
    block, origin = list(shape), [0] * len(shape)
    for size, coord, dim in layout:
        assert shape[dim] % size == 0, f"uneven model-parallel shard: dim {dim} of {tuple(shape)} over {size}"
        block[dim] //= size
        origin[dim] += coord * block[dim]
    return tuple(block), tuple(origin)


def _piece_in_full(shape: torch.Size, block, origin, start: int, count: int):
    """Where the local block's elements [start, start + count) (in the local tensor's
    row-major order; the block as _local_block gives it) lie in the flattened full
    parameter: an offset where they are contiguous there, else a LongTensor of their flat
    indices. A block that is one contiguous region of the full tensor (the whole
    parameter, or a block cut on its first dim of extent > 1) gives the offset without
    building index tensors (materializing every parameter's indices at every comparison
    was most of the MoE tests' comparison time: qwen3's 64 experts)."""
    if count == 0:
        return 0
    cut = [d for d in range(len(shape)) if block[d] != shape[d]]
    if not cut or all(block[d] == 1 for d in range(cut[0])):
        stride, base = 1, 0
        for d in reversed(range(len(shape))):
            base += origin[d] * stride
            stride *= shape[d]
        return base + start
    idx = torch.arange(shape.numel()).reshape(shape)[tuple(slice(o, o + b) for o, b in zip(origin, block))]
    where = idx.reshape(-1)[start: start + count]
    if bool((where == torch.arange(int(where[0]), int(where[0]) + where.numel())).all()):
        return int(where[0])
    return where


def _ours_piece(name: str, p: torch.Tensor, which: str, shape: torch.Size, layout):
    """(where in the flattened full parameter: an offset where the piece is contiguous
    there, else a LongTensor of flat indices; this rank's 1-D piece) of one of our sharded
    parameters. Built on the harness' shard_piece (the unit, the parameter's index in it
    and this rank's ShardSlice: the piece's offset in the parameter's LOCAL tensor, whose
    shape the unit's param_spec gives). The local tensor is this rank's model-parallel
    block (_model_parallel_layouts: tp rank's Shard(d) block of a TP-sharded dense weight,
    ep rank's Shard(0) block of an expert weight, else the whole parameter); its shape must
    be that block's. A piece of a block cut on dim 0 is contiguous in the full tensor, one
    cut on another dim strided."""
    state, index, piece = shard_piece(p)
    local_shape = torch.Size(state.unit.param_spec(index).shape)
    t = p.grad if which == "grad" else p
    if t is None:
        return None
    t = t.detach().as_subclass(torch.Tensor).reshape(-1).float().cpu()  # fp32 gradients: nothing lost
    block, origin = _local_block(shape, layout)
    assert block == tuple(local_shape), (f"'{name}': our local tensor has shape {tuple(local_shape)}, the "
                                         f"model-parallel block {layout} of {tuple(shape)} {block}")
    assert 0 <= piece.param_offset and piece.param_offset + t.numel() <= local_shape.numel(), \
        f"'{name}': a piece of {t.numel()} at {piece.param_offset} past its block"
    return _piece_in_full(shape, block, origin, piece.param_offset, t.numel()), t


def _rel(a, b) -> float:
    if isinstance(a, torch.Tensor):
        a, b = a.double(), b.double()
        den = b.norm().item()
        return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()
    return abs(a - b) / max(abs(b), 1e-30)


def _pieces(model, impl: str, which: str, shapes: Dict[str, torch.Size], layouts: Optional[Dict]
            ) -> Iterator[Tuple[str, Optional[torch.Tensor], object, torch.Tensor]]:
    """For every parameter in order: (name, its full value or gradient in float64 (FSDP2:
    .full_tensor(), a collective; ours: None), where this rank's piece lies in the
    flattened full tensor (an offset, or a LongTensor of flat indices), this rank's 1-D
    piece in float64). FSDP2's piece: this rank's equal chunk of the full tensor; ours: its
    own shard piece (_ours_piece, with `layouts`). Collective: every rank walks the
    parameters in order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for n, p in model.named_parameters():
        name = plain_name(n)
        if impl == "fsdp2":
            t = p.grad if which == "grad" else p
            assert t is not None, f"FSDP2: no {which} for '{name}'"
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().cpu()
            chunk = full.numel() // world + (full.numel() % world > 0)
            offset = min(rank * chunk, full.numel())
            yield name, full, offset, full.reshape(-1)[offset: offset + chunk]
        else:
            got = _ours_piece(name, p, which, shapes[name], layouts[name])
            assert got is not None, f"ours: no {which} for '{name}' on rank {rank}"
            yield name, None, got[0], got[1].double()


def _check_cover(names, spans) -> None:
    """Rank 0: each parameter's pieces on all ranks cover it (replicas may overlap).
    spans: per rank, {name: (offset, length) or a LongTensor of flat indices}; names:
    {name: numel}."""
    def show(span):
        return span if isinstance(span, tuple) else f"{span.numel()} strided indices"

    for name, numel in names.items():
        covered = torch.zeros(numel, dtype=torch.bool)
        for by_rank in spans:
            span = by_rank[name]
            if isinstance(span, tuple):
                offset, length = span
                assert 0 <= offset and offset + length <= numel, \
                    f"'{name}': a piece [{offset}, {offset + length}) outside its {numel} elements"
                covered[offset: offset + length] = True
            else:
                assert span.numel() == 0 or (0 <= int(span.min()) and int(span.max()) < numel), \
                    f"'{name}': a piece's indices outside its {numel} elements"
                covered[span] = True
        if not covered.all():
            raise AssertionError(f"'{name}' ({numel} elements): the ranks' pieces do not cover it: "
                                 f"per rank {[show(r[name]) for r in spans]}")


def _compare_full(pair, which: str, shapes, layouts, init: Optional[Dict] = None) -> Dict:
    """The largest relative difference over parameters between the two models' full
    values (or gradients) and where it is, and each side's float64 2-norm over all of
    them. Each rank compares its own piece of the second model against the same elements
    of the reference's full tensor (FSDP2's .full_tensor() on every rank): no pieces move
    but the squared sums (one all-reduce) and the pieces' spans (checked to cover every
    parameter). Replicas (HSDP's, a TP-replicated parameter's tp ranks) count in both sums
    alike; the second side's norm divides them out. With `init` (rank 0's initial values):
    how far the reference moved from them (largest relative change). The same on every
    rank. pair: ((impl, model) of the reference, (impl, model)); layouts: see
    _model_parallel_layouts."""
    (ref_impl, ref), (impl, other) = pair
    assert ref_impl == "fsdp2", "the reference is FSDP2's model"
    names, stats, spans = [], [], {}
    ref_sq, moved = 0.0, 0.0
    for (name, full, _, _), (name_b, _, where, piece) in zip(_pieces(ref, ref_impl, which, shapes, layouts),
                                                              _pieces(other, impl, which, shapes, layouts)):
        assert name == name_b, f"parameter order differs: '{name}' vs '{name_b}'"
        assert full.numel() == shapes[name].numel(), f"'{name}': FSDP2's full {which} has shape {tuple(full.shape)}"
        if isinstance(where, torch.Tensor):
            there = full.reshape(-1)[where]
            spans[name] = where
        else:
            there = full.reshape(-1)[where: where + piece.numel()]
            spans[name] = (where, piece.numel())
        assert there.numel() == piece.numel(), f"'{name}': a piece of {piece.numel()} at {where} is out of range"
        names.append(name)
        stats.append([float((piece - there).norm() ** 2), float(there.norm() ** 2), float(piece.norm() ** 2),
                      float(piece.numel())])
        ref_sq += float(full.norm() ** 2)
        if init is not None:
            moved = max(moved, _rel(full, init[name]))
    sums = torch.tensor(stats, dtype=torch.float64)
    dist.all_reduce(sums)
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(spans, every, dst=0)
    if dist.get_rank() == 0:
        _check_cover({n: shapes[n].numel() for n in names}, every)
    diff, there, mine, count = sums.unbind(1)
    rel = diff.sqrt() / there.sqrt().clamp_min(1e-300)
    rel = torch.where(there > 0, rel, diff.sqrt())
    copies = count / torch.tensor([shapes[n].numel() for n in names], dtype=torch.float64)
    at = int(rel.argmax())
    out = [{"max_rel": float(rel[at]), "at": names[at], "norm_ref": ref_sq ** 0.5,
            "norm_other": float((mine / copies).sum()) ** 0.5, "moved": moved}]
    dist.broadcast_object_list(out, src=0)  # rank 0's "moved"
    return out[0]


def _state_dict_values(pair) -> float:
    """The largest relative difference between the two models' state-dict values (what DCP
    saves of each): entry by entry, this rank's local parts where both are DTensors placed
    alike (no gathers; the squared norms summed over the ranks, replicas counted alike on
    both sides), else the full tensors."""
    (_, ref), (impl, other) = ((k, m.state_dict()) for k, m in pair)
    assert sorted(ref) == sorted(other), f"state-dict keys: {impl} {sorted(other)} vs FSDP2 {sorted(ref)}"
    keys = sorted(ref)
    sums = torch.zeros(len(keys), 2, dtype=torch.float64)
    for i, key in enumerate(keys):
        a, b = ref[key], other[key]
        assert tuple(a.shape) == tuple(b.shape), \
            f"state dict '{key}': {impl} shape {tuple(b.shape)} vs FSDP2 {tuple(a.shape)}"
        if isinstance(a, DTensor) and isinstance(b, DTensor) and _describe(a)[1] == _describe(b)[1] \
                and a.device_mesh.mesh.tolist() == b.device_mesh.mesh.tolist():
            a, b = a.to_local(), b.to_local()
            scale = 1.0
        else:  # gathered whole on every rank: counted once
            a = a.full_tensor() if isinstance(a, DTensor) else a
            b = b.full_tensor() if isinstance(b, DTensor) else b
            scale = 1.0 / dist.get_world_size()
        a, b = a.detach().double(), b.detach().double()
        sums[i, 0] = scale * float((a - b).norm() ** 2)
        sums[i, 1] = scale * float(a.norm() ** 2)
    dist.all_reduce(sums)
    rel = sums[:, 0].sqrt() / sums[:, 1].sqrt().clamp_min(1e-300)
    return float(rel.max())


# ------------------------------------------------------------------ grad norms

def _grad_norm(model, ep: int) -> float:
    """The total grad norm each side's training loop clips by (max_norm 1e9: nothing is
    scaled): torchtitan's clip_grad_norm_, unchanged, on both sides (its EP path with
    ep > 1, which asserts that every parameter and gradient is a DTensor and splits them
    by their mesh's "ep" dim: expert and dense DTensor grads live on different meshes)."""
    from torchtitan.distributed import utils as dist_utils

    norm = dist_utils.clip_grad_norm_(list(model.parameters()), 1e9, foreach=True, ep_enabled=ep > 1)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _ep_split(model) -> Dict[str, list]:
    """After backward: the parameters torchtitan's EP clip counts as experts (their mesh
    has an "ep" dim), and those with a gradient that are not DTensors to it."""
    expert, plain = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not (isinstance(p, DTensor) and isinstance(p.grad, DTensor)):
            plain.append(name)
        elif "ep" in (p.device_mesh.mesh_dim_names or ()):
            expert.append(name)
    return {"expert": expert, "not_dtensor": plain}


# ------------------------------------------------------------------ the worker

def moe_train_vs_fsdp2(rank: int, world: int, model: str, ep: int, num_experts: Optional[int] = None,
                       dp_replicate: int = 1, steps: int = 4, impl: str = "ours", layers: Optional[int] = None,
                       local_bs: int = 2, fp32_experts: bool = True, tp: int = 1, sp: bool = True) -> Dict:
    """torchtitan's MoE debug model `model` ("dsv3" or "qwen3") parallelized by its own
    parallelize function with FSDP2 and with `impl`'s fully_shard ("ours"; "fsdp2": FSDP2
    against itself, which checks this comparison), trained `steps` steps side by side.
    tp > 1: torchtitan's tensor parallelism on the dense weights as well (sequence
    parallel when `sp`, torchtitan's default), dp_shard = world / (dp_replicate * tp) and
    efsdp = dp_shard * tp / ep (torchtitan 0.3.0: EP borrows ranks from FSDP and TP; the
    routed experts are not TP-sharded when ep > 1).
    Returns (the same on every rank):
      losses: [(fsdp2, impl)] per step, the mean over the dp ranks of their local losses;
      grad_norms: [(fsdp2, impl)] per step (see _grad_norm);
      ep_split: [fsdp2's, impl's] _ep_split after the first backward (the parameters
        torchtitan's EP clip takes for experts, and any it would not take for DTensors);
      worst: max relative differences: loss, grad_norm (over steps), grad (every
        parameter's full gradient after the last backward), param (every parameter's full
        value after the last step), param_state_dict (the state dicts' values then),
        norm_vs_full_fsdp2 / norm_vs_full_impl (each side's last grad norm against the
        norm of its full gradients);
      grad_at / param_at: the parameter where grad / param differ most;
      placements: {"fsdp2": ..., impl: ...} (mesh dim names, placements) of EXPERT_W1 in
        each model's state_dict(); placement_mismatches: every state-dict entry whose
        placements differ (or that one side lacks); mesh_name_mismatches: {entry: (FSDP2's
        mesh dim names, impl's)} where those differ;
      moved: how far FSDP2's parameters moved (largest relative change);
      sharded_on: {"tp": n, "ep": n}: how many of FSDP2's parameters are Shard()-placed on
        that mesh dim; meshes: the degrees (dp_shard, tp, ep, efsdp);
      timings: this rank's seconds in setup (imports, meshes), build (both models),
        parallelize (both), train (the steps) and compare (full gradients and values);
        wall_s: all of it."""
    wall0 = time.perf_counter()
    assert impl in ("ours", "fsdp2"), f"impl {impl!r}: 'ours' or 'fsdp2'"
    install_trainer_stubs()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    tt_parallel_dims.device_type = device_for_backend().type
    dist_utils.set_spmd_backend("partial_dtensor")
    dp_shard = world // (dp_replicate * tp)
    pcfg = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=ep,
                             data_parallel_shard_degree=dp_shard, data_parallel_replicate_degree=dp_replicate,
                             tensor_parallel_degree=tp, enable_sequence_parallel=sp)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=ep, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    batch_mesh = dims.get_mesh("batch")
    dp_world, dp_index = batch_mesh.size(), batch_mesh.get_local_rank()

    timings = {"setup": time.perf_counter() - wall0}
    if fp32_experts:
        use_fp32_experts()
    spec = _moe_spec(model, num_experts, layers, pcfg)
    ref = _build(spec)
    # The second model: a copy of the reference's module tree (a second seeded build with
    # torchtitan's init costs seconds per rank), its state loaded from the reference's
    # state dict; checked equal below.
    other = copy.deepcopy(ref)
    other.load_state_dict(ref.state_dict())
    for (n, a), (_, b) in zip(ref.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), f"the second model's '{n}' is not a copy"
    shapes = {plain_name(n): p.shape for n, p in ref.named_parameters()}
    init = {plain_name(n): p.detach().clone() for n, p in ref.named_parameters()} if rank == 0 else None

    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    models, t0 = {}, time.perf_counter()
    for which, m in (("fsdp2", ref), (impl, other)):
        with _fully_shard_in_torchtitan(which):
            m = spec.parallelize_fn(m, parallel_dims=dims, training=training, parallelism=pcfg,
                                    compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
        m.train()
        if which == "fsdp2" and dist.get_backend() == "gloo":
            for fm in _fsdp2_modules(m):
                fm.set_force_sum_reduction_for_comms(True)
        key = "ours" if which == "ours" else ("fsdp2" if not models else "fsdp2_b")
        models[key] = m
    timings["build"] = t0 - wall0 - timings["setup"]
    timings["parallelize"] = time.perf_counter() - t0
    impl_key = list(models)[1]
    layouts = _model_parallel_layouts(models["fsdp2"])
    sharded_on = {}  # how many of FSDP2's parameters are sharded on each model-parallel mesh dim
    for p in models["fsdp2"].parameters():
        if not isinstance(p, DTensor):
            continue
        for dim_name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements):
            if dim_name in MODEL_PARALLEL_DIMS and placement.is_shard():
                sharded_on[dim_name] = sharded_on.get(dim_name, 0) + 1
    pair = (("fsdp2", models["fsdp2"]), ("fsdp2" if impl == "fsdp2" else "ours", models[impl_key]))

    sds = {k: m.state_dict() for k, m in models.items()}
    placements = {k: _describe(sd[EXPERT_W1]) if EXPERT_W1 in sd else None for k, sd in sds.items()}
    common = [key for key in sds["fsdp2"] if key in sds[impl_key]]
    mismatches = sorted(set(sds["fsdp2"]) ^ set(sds[impl_key]))  # entries only one side has
    mismatches += [k for k in common if _describe(sds["fsdp2"][k])[1] != _describe(sds[impl_key][k])[1]]
    mesh_names = {k: (_describe(sds["fsdp2"][k])[0], _describe(sds[impl_key][k])[0]) for k in common
                  if _describe(sds["fsdp2"][k])[0] != _describe(sds[impl_key][k])[0]}
    del sds

    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=False, foreach=False) for k, m in models.items()}
    device = device_for_backend()
    losses, norms = [], []
    worst: Dict[str, float] = {"loss": 0.0, "grad_norm": 0.0}
    result: Dict = {}
    rows = slice(dp_index * local_bs, (dp_index + 1) * local_bs)
    t0 = time.perf_counter()
    timings["train"] = timings["compare"] = 0.0
    split: Dict[str, Dict[str, list]] = {}
    for step, (tokens, labels) in enumerate(_batches(steps, local_bs, dp_world)):
        step_losses, step_norms = [], []
        for k, m in models.items():
            loss = _loss(m, tokens[rows].to(device), labels[rows].to(device))
            (loss / dp_world).backward()
            total = loss.detach().double().cpu().reshape(1)
            dist.all_reduce(total)  # the tp ranks of a dp rank have its loss each (cp = pp = 1)
            step_losses.append(float(total) / world)
            if step == 0:
                split[k] = _ep_split(m)
            step_norms.append(_grad_norm(m, ep))
        losses.append(tuple(step_losses))
        norms.append(tuple(step_norms))
        worst["loss"] = max(worst["loss"], _rel(step_losses[1], step_losses[0]))
        worst["grad_norm"] = max(worst["grad_norm"], _rel(step_norms[1], step_norms[0]))
        if step == steps - 1:
            timings["train"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            g = _compare_full(pair, "grad", shapes, layouts)
            worst["grad"], result["grad_at"] = g["max_rel"], g["at"]
            worst["norm_vs_full_fsdp2"] = _rel(step_norms[0], g["norm_ref"])
            worst["norm_vs_full_impl"] = _rel(step_norms[1], g["norm_other"])
            timings["compare"] += time.perf_counter() - t0
            t0 = time.perf_counter()
        for o in opts.values():
            o.step()
            o.zero_grad()
    timings["train"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    v = _compare_full(pair, "value", shapes, layouts, init)
    worst["param"], result["param_at"] = v["max_rel"], v["at"]
    worst["param_state_dict"] = _state_dict_values(pair)
    moved = v["moved"]
    timings["compare"] += time.perf_counter() - t0
    result.update(losses=losses, grad_norms=norms, ep_split=[split[k] for k in models], worst=worst,
                  placements=placements,
                  placement_mismatches=mismatches, mesh_name_mismatches=mesh_names, moved=moved, impl=impl,
                  sharded_on=sharded_on, meshes={"dp_shard": dp_shard, "tp": tp, "ep": ep,
                                                 "efsdp": dims.get_mesh("efsdp").size() if ep > 1 else None},
                  timings=timings, wall_s=time.perf_counter() - wall0)
    return result
