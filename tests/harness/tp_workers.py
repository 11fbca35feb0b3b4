"""Tensor parallel x fully_shard workers: a small transformer-like model parallelized with
torch's parallelize_module (ColwiseParallel, RowwiseParallel, SequenceParallel) on the "tp"
dim of a (dp_shard, tp) or (dp_replicate, dp_shard, tp) mesh, sharded with our fully_shard
on the data-parallel dims, trained against one plain process on the whole batch (fp32:
gradients, clipped norms, losses and parameters every step) and against FSDP2+TP on the
same mesh (bf16)."""
from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .funcol_c10d import route_functional_collectives_through_c10d
from .workers import device_for_backend, expect_error, flat_piece, rel_err, shard_piece

D_IN, D, H, D_OUT, SEQ = 8, 16, 32, 4, 8
SEED = 7


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


def checkpointed(block: nn.Module) -> nn.Module:
    """torch's activation checkpointing around a block (torchtitan's wrapper): its forward
    runs again inside backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block)


class TPNet(nn.Module):
    def __init__(self, n_blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def build(device, n_blocks: int = 2) -> TPNet:
    torch.manual_seed(SEED)
    model = TPNet(n_blocks).to(device)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make their gradients tell ranks apart
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def parallelize(model: TPNet, tp_mesh, sp: bool) -> TPNet:
    """Megatron's TP on the blocks (w1 column-, w2 row-parallel), the input projection
    row-parallel and the head column-parallel; with sequence parallel the norms run on
    sequence shards (SequenceParallel) and activations between blocks stay split on dim 1."""
    seq = Shard(1) if sp else Replicate()
    plan = {
        "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    for block in model.blocks:
        block_plan = {"w1": ColwiseParallel(input_layouts=seq), "w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            block_plan["norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, block_plan)
    return model


def make_mesh(shape: Tuple[int, ...]):
    if dist.get_backend() == "gloo" and device_for_backend().type == "cuda":
        route_functional_collectives_through_c10d()
    names = ("dp_shard", "tp") if len(shape) == 2 else ("dp_replicate", "dp_shard", "tp")
    return init_device_mesh(device_for_backend().type, shape, mesh_dim_names=names)


def dp_mesh_of(mesh):
    names = mesh.mesh_dim_names
    return mesh["dp_shard"] if len(names) == 2 else mesh[("dp_replicate", "dp_shard")]


def dp_rank_of(mesh) -> Tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number)."""
    coord = mesh.get_coordinate()
    sizes = mesh.mesh.shape
    index, count = 0, 1
    for c, s in zip(coord[:-1], sizes[:-1]):
        index, count = index * s + c, count * s
    return index, count


def _offload_policy() -> CPUOffloadPolicy:
    """Pinned host memory with CUDA tensors (the GPU suite), plain host memory on the CPU
    (FSDP2 cannot pin without an accelerator)."""
    return CPUOffloadPolicy(pin_memory=device_for_backend().type == "cuda")


def shard_ours(model: TPNet, dp_mesh, sc: Dict, mesh=None) -> TPNet:
    if sc.get("config"):  # Megatron's spelling: FSDPConfig + fully_shard_model with named mesh dims
        three = len(mesh.mesh_dim_names) == 3
        return mfsdp.fully_shard_model(
            model, mfsdp.FSDPConfig(data_parallel_sharding_strategy=sc.get("strategy", "optim_grads_params")),
            fsdp_unit_modules=[Block], device_mesh=mesh, dp_shard_dim="dp_shard",
            dp_outer_dim="dp_replicate" if three else None, tp_dim="tp")
    mp = None
    if sc.get("bf16"):
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mesh=dp_mesh, sharding_strategy=sc.get("strategy", "optim_grads_params"),
              gather_bucket_bytes=sc.get("buckets", 0), reduce_bucket_bytes=sc.get("buckets", 0),
              prefetch_depth=sc.get("prefetch", 1))
    if mp is not None:
        kw["mp_policy"] = mp
    if sc.get("offload"):
        kw["offload_policy"] = _offload_policy()
    for block in model.blocks:
        mfsdp.fully_shard(block, **kw)
    mfsdp.fully_shard([model.norm, model.head], **kw)
    return mfsdp.fully_shard(model, **kw)


def batches(steps: int, per: int, dp_world: int, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(dp_world * per, SEQ, D_IN, generator=g), torch.randn(dp_world * per, SEQ, D_OUT, generator=g)


def plain_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper level."""
    return name.replace("_checkpoint_wrapped_module.", "")


def placements_of(model) -> Dict[str, Tuple]:
    """Each parameter's TP placements (Replicate for plain ones), read before sharding."""
    return {plain_name(n): tuple(p.placements) if isinstance(p, DTensor) else (Replicate(),)
            for n, p in model.named_parameters()}


def full_of_ours(model, which: str, tp_placements: Dict[str, Tuple], tp_mesh=None) -> Dict[str, torch.Tensor]:
    """Every parameter's full gradient (or value) rebuilt from all ranks' 1-D pieces with
    nothing of the library's state-dict code: data-parallel pieces at their layout offsets
    into the local TP shard, then the TP shards joined as their placements say (tp_mesh
    None: no TP). Checks on the way that replicas (HSDP's, and tp ranks of a replicated
    parameter) agree."""
    local = {}
    for name, p in model.named_parameters():
        state, idx, piece = shard_piece(p)
        t = p.grad if which == "grad" else p
        t = None if t is None else flat_piece(t).double().cpu()
        local[plain_name(name)] = (piece.param_offset, tuple(state.unit.param_spec(idx).shape), t)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (tp_mesh.get_local_rank() if tp_mesh is not None else 0, local))
    full = {}
    for name, placements in tp_placements.items():
        shards = {}
        for tp_rank, by_rank in every:
            offset, shape, t = by_rank[name]
            assert t is not None, f"no {which} for '{name}'"
            out = shards.setdefault(tp_rank, torch.full(shape, float("nan"), dtype=torch.float64)).view(-1)
            seen = out[offset: offset + t.numel()]
            known = ~torch.isnan(seen)
            assert torch.equal(seen[known], t[known]), f"'{name}': replicas disagree on {which} (tp rank {tp_rank})"
            seen.copy_(t)
        ordered = [shards[r] for r in sorted(shards)]
        for s in ordered:
            assert not torch.isnan(s).any(), f"'{name}': {which} pieces do not cover the local shard"
        placement = placements[0]
        if isinstance(placement, Shard):
            full[name] = torch.cat(ordered, dim=placement.dim)
        else:
            for s in ordered[1:]:
                assert torch.allclose(s, ordered[0], rtol=1e-6, atol=1e-7), \
                    f"'{name}' is replicated over tp but its {which} differs across tp ranks"
            full[name] = ordered[0]
    return full


def tp_parity(rank: int, world: int, shape: Tuple[int, ...], scenarios: List[Dict]) -> List[Dict]:
    """For each scenario (keys: sp, strategy, clip, micro, buckets, prefetch, ac, config, offload; all
    fp32): TP on the mesh's "tp" dim and our fully_shard on its data-parallel
    dims train like one plain process on the whole batch, step by step."""
    device = device_for_backend()
    mesh = make_mesh(shape)
    tp_mesh, dp_mesh = mesh["tp"], dp_mesh_of(mesh)
    dp_index, dp_world = dp_rank_of(mesh)
    results = []
    for sc in scenarios:
        ref = build(device)
        model = parallelize(copy.deepcopy(ref), tp_mesh, sc.get("sp", False))
        if sc.get("ac"):  # after TP, before FSDP, as torchtitan applies them
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpointed(block)
        placements = placements_of(model)
        shard_ours(model, dp_mesh, sc, mesh)
        units = [s for s in iter_states(model) if s.unit is not None]
        assert all(s.unit.world_size == shape[-2] for s in units)
        # offload: every unit's shard (TP DTensors' local pieces included) in host memory
        assert all(s.unit.offloaded == bool(sc.get("offload")) for s in units), sc
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        micro, per, worst, clip = sc.get("micro", 1), 2, 0.0, sc.get("clip")
        tol = sc.get("tol", 1e-5)
        for step, (x, y) in enumerate(batches(3, per * micro, dp_world)):
            loss = ref_loss = 0.0
            for m in range(micro):
                if micro > 1:
                    model.set_requires_gradient_sync(m == micro - 1)
                lo = (dp_index * micro + m) * per
                out = model(x[lo: lo + per].to(device))
                assert not isinstance(out, DTensor)
                l_ = F.mse_loss(out, y[lo: lo + per].to(device)) / micro
                l_.backward()
                loss += l_.item()
            for m in range(micro):
                # The reference sees each micro-batch as the union of every dp rank's rows.
                xs = torch.cat([x[(r * micro + m) * per: (r * micro + m + 1) * per] for r in range(dp_world)])
                ys = torch.cat([y[(r * micro + m) * per: (r * micro + m + 1) * per] for r in range(dp_world)])
                l_ = F.mse_loss(ref(xs.to(device)), ys.to(device)) / micro
                l_.backward()
                ref_loss += l_.item()
            # Our loss is this dp rank's; the mean over dp ranks is the reference's.
            losses = [None] * world
            dist.all_gather_object(losses, loss)
            assert abs(sum(losses) / world - ref_loss) <= tol * max(1.0, abs(ref_loss)), \
                f"{sc} step {step}: loss {sum(losses) / world} vs {ref_loss}"
            ours = full_of_ours(model, "grad", placements, tp_mesh)
            for name, p in ref.named_parameters():
                err = rel_err(ours[name].reshape(p.shape), p.grad)
                assert err <= tol, f"{sc} step {step}: gradient of '{name}' rel err {err:.3e}"
                worst = max(worst, err)
            if clip is not None:
                norm = mfsdp.clip_grad_norm_(model, clip)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                assert rel_err(norm, ref_norm) <= tol, f"{sc}: clip norm {norm.item()} vs {ref_norm.item()}"
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        values = full_of_ours(model, "value", placements, tp_mesh)
        param_err = max(rel_err(values[n].reshape(p.shape), p.detach()) for n, p in ref.named_parameters())
        assert param_err <= tol, f"{sc}: parameters after 3 steps: rel err {param_err}"
        results.append({"scenario": sc, "grad_err": worst, "param_err": param_err})
    return results


def shard_fsdp2(model: TPNet, dp_mesh, bf16: bool = False, offload: bool = False) -> TPNet:
    """FSDP2 (torch's fully_shard) on the same units as shard_ours."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=dp_mesh)
    if offload:
        kw["offload_policy"] = _offload_policy()
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [*model.blocks, [model.norm, model.head], model]
    for u in units:
        fully_shard(u, **kw)
    if dist.get_backend() == "gloo":  # Gloo's reduce-scatter has no average
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _step(model, opt, dp_index: int, dp_world: int, seed: int = 5) -> None:
    x, y = next(batches(1, 2, dp_world, seed))
    device = device_for_backend()
    F.mse_loss(model(x[2 * dp_index: 2 * dp_index + 2].to(device)), y[2 * dp_index: 2 * dp_index + 2].to(device)
               ).backward()
    opt.step()
    opt.zero_grad()


def _same_dtensors(ours: Dict, theirs: Dict, what: str, tol: float = 1e-6) -> int:
    """Every entry of two (flattened) state dicts: the same type, mesh (dim names and
    ranks), placements, shape and local values."""
    assert set(ours) == set(theirs), f"{what}: keys differ: {sorted(set(ours) ^ set(theirs))[:5]}"
    checked = 0
    for k, a in ours.items():
        b = theirs[k]
        if not isinstance(b, torch.Tensor):
            continue
        assert type(a) is type(b), f"{what} '{k}': {type(a).__name__} vs FSDP2's {type(b).__name__}"
        if isinstance(b, DTensor):
            assert tuple(a.placements) == tuple(b.placements), \
                f"{what} '{k}': placements {a.placements} vs FSDP2's {b.placements}"
            assert a.device_mesh.mesh_dim_names == b.device_mesh.mesh_dim_names and \
                torch.equal(a.device_mesh.mesh, b.device_mesh.mesh), \
                f"{what} '{k}': mesh {a.device_mesh} vs FSDP2's {b.device_mesh}"
            assert a.shape == b.shape and a.stride() == b.stride(), f"{what} '{k}': shape {a.shape} vs {b.shape}"
            a, b = a.to_local(), b.to_local()
        assert a.shape == b.shape, f"{what} '{k}': local shape {tuple(a.shape)} vs FSDP2's {tuple(b.shape)}"
        assert rel_err(a.double(), b.double()) <= tol, f"{what} '{k}': values differ"
        checked += 1
    return checked


def _full(sd: Dict) -> Dict[str, torch.Tensor]:
    return {k: (_full_tensor(v) if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _full_tensor(t: DTensor) -> torch.Tensor:
    """full_tensor(), also of an offloaded unit's entry (FSDP2's form too: host local
    pieces on a CUDA mesh, which NCCL cannot gather as they are)."""
    if t.to_local().device.type != t.device_mesh.device_type:
        t = DTensor.from_local(t.to_local().to(t.device_mesh.device_type), t.device_mesh, t.placements,
                               shape=t.shape, stride=t.stride())
    return t.full_tensor()


def _flat_optim(sd: Dict) -> Dict:
    return {f"{k}.{n}": v for k, entry in sd["state"].items() for n, v in entry.items()}


def tp_state_dicts(rank: int, world: int, path: str, offload: bool = False) -> Dict:
    """(At world 4, as below; at world W the mesh is (W/2) x 2, the reshards W x 1 and 1 x W.)
    State dicts of ours+TP equal FSDP2+TP's on the same 2x2 mesh (placements,
    _StridedShard included, and values, model and AdamW state after one identical step);
    DCP checkpoints move both ways between them, and reshard to 4x1 and 1x4 meshes and to
    a plain model, and back; save_checkpoint/load_checkpoint do the same. offload: every
    model of both systems with CPUOffloadPolicy (_offload_policy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    device = device_for_backend()
    report = {}

    def trained(shape, system: str, sp: bool = True, step: bool = True):
        mesh = make_mesh(shape)
        model = parallelize(build(device), mesh["tp"], sp)
        if system == "fsdp2":
            shard_fsdp2(model, dp_mesh_of(mesh), offload=offload)
        else:
            shard_ours(model, dp_mesh_of(mesh), {"offload": offload})
            assert all(s.unit.offloaded == offload for s in iter_states(model) if s.unit is not None)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if step:
            _step(model, opt, *dp_rank_of(mesh))
        return model, opt

    base = (world // 2, 2)  # dp x tp; reshards to (world, 1) and (1, world)
    ours, ours_opt = trained(base, "ours")
    theirs, theirs_opt = trained(base, "fsdp2")
    msd, tsd = get_model_state_dict(ours), get_model_state_dict(theirs)
    report["model_entries"] = _same_dtensors(msd, tsd, "model state dict", tol=1e-5)
    strided = [k for k, v in msd.items() if any(type(p).__name__ == "_StridedShard" for p in v.placements)]
    assert strided, "no parameter placed _StridedShard: TP and dp both shard dim 0 of column-parallel weights"
    report["strided"] = len(strided)
    osd, tosd = get_optimizer_state_dict(ours, ours_opt), get_optimizer_state_dict(theirs, theirs_opt)
    report["optim_entries"] = _same_dtensors(_flat_optim(osd), _flat_optim(tosd), "optimizer state dict", tol=1e-4)
    want = _full(msd)

    want_optim = _full(_flat_optim(osd))

    def holds_trained_state(model, opt, what: str) -> None:
        """`model` and `opt` now hold the trained 2x2 values and AdamW state."""
        got = _full(get_model_state_dict(model))
        for k, v in want.items():
            assert rel_err(got[k], v) <= 1e-5, f"{what}: '{k}' differs"
        got_opt = _full(_flat_optim(get_optimizer_state_dict(model, opt)))
        for k, v in want_optim.items():
            assert rel_err(got_opt[k].double(), v.double()) <= 1e-4, f"{what}: optimizer '{k}' differs"

    # DCP: ours -> FSDP2, FSDP2 -> ours (fresh, untrained targets).
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/ours_2x2")
    dcp.save({"model": tsd, "optim": tosd}, checkpoint_id=f"{path}/fsdp2_2x2")
    for src, system in (("ours_2x2", "fsdp2"), ("fsdp2_2x2", "ours")):
        model, opt = trained(base, system, step=False)
        _step(model, opt, *dp_rank_of(make_mesh(base)), seed=11)  # different values and state, to be replaced
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=f"{path}/{src}")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        holds_trained_state(model, opt, f"dcp.load {src} -> {system}")

    def load_and_compare(model, checkpoint: str, expected: Dict, what: str) -> None:
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=f"{path}/{checkpoint}")
        set_model_state_dict(model, sd["model"])
        got = _full(get_model_state_dict(model))
        for k, v in expected.items():
            assert rel_err(got[k], v.cpu()) <= 1e-5, f"{what}: '{k}' differs"

    # Reshard: 2x2 -> 4x1, 1x4 and back; and to a plain model.
    for shape in ((world, 1), (1, world)):
        model, opt = trained(shape, "ours", step=False)
        load_and_compare(model, "ours_2x2", want, f"2x2 -> {shape}")
        name = f"ours_{shape[0]}x{shape[1]}"
        with torch.no_grad():  # a change the way back must carry
            model.head.weight.add_(1.0)
        changed = _full(get_model_state_dict(model))
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{path}/{name}")
        load_and_compare(trained(base, "ours", step=False)[0], name, changed, f"{shape} -> 2x2")
    plain = build(device)
    sd = {k: torch.empty_like(v) for k, v in plain.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=f"{path}/ours_2x2")
    for k, v in want.items():
        assert rel_err(sd[k].cpu(), v) <= 1e-5, f"2x2 -> plain: '{k}' differs"
    with torch.no_grad():
        plain.load_state_dict(sd)
        plain.inp.weight.mul_(2.0)
    dcp.save({"model": plain.state_dict()}, checkpoint_id=f"{path}/plain")
    load_and_compare(trained(base, "ours", step=False)[0], "plain", plain.state_dict(), "plain -> 2x2")

    # save_checkpoint / load_checkpoint: 2x2 -> 1x4 (model and optimizer).
    mfsdp.save_checkpoint(f"{path}/ckpt", ours, ours_opt)
    model, opt = trained((1, world), "ours", step=False)
    _step(model, opt, *dp_rank_of(make_mesh((1, world))), seed=11)
    mfsdp.load_checkpoint(f"{path}/ckpt", model, opt)
    holds_trained_state(model, opt, "load_checkpoint 2x2 -> 1x4")
    return report


def worst_against_fsdp2(ours, theirs, which: str, placements: Dict[str, Tuple], tp_mesh, tol: float,
                        what: str) -> float:
    """The largest relative error of our full gradients (or values) against FSDP2's (its
    DTensors gathered), each asserted <= tol."""
    mine, worst = full_of_ours(ours, which, placements, tp_mesh), 0.0
    for name, p in theirs.named_parameters():
        full = (p.grad if which == "grad" else p).full_tensor().double().cpu()
        e = rel_err(mine[name].reshape(full.shape), full)
        assert e <= tol, f"{what}: {which} of '{name}' rel err {e:.3e} against FSDP2's"
        worst = max(worst, e)
    return worst


def tp_vs_fsdp2(rank: int, world: int, shape: Tuple[int, ...], sp: bool, steps: int = 3) -> Dict:
    """Ours+TP and FSDP2+TP on the same mesh, both in bf16 (param bf16, reduce fp32): the
    same losses and gradients step by step, and the same parameters after."""
    device = device_for_backend()
    mesh = make_mesh(shape)
    dp_index, dp_world = dp_rank_of(mesh)
    ours = parallelize(build(device), mesh["tp"], sp)
    placements = placements_of(ours)
    shard_ours(ours, dp_mesh_of(mesh), {"bf16": True})
    theirs = shard_fsdp2(parallelize(build(device), mesh["tp"], sp), dp_mesh_of(mesh), bf16=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ours, theirs)]
    worst = {"loss": 0.0, "grad": 0.0}
    for step, (x, y) in enumerate(batches(steps, 2, dp_world)):
        xs, ys = x[2 * dp_index: 2 * dp_index + 2].to(device), y[2 * dp_index: 2 * dp_index + 2].to(device)
        losses = []
        for m in (ours, theirs):
            loss = F.mse_loss(m(xs).float(), ys)
            loss.backward()
            losses.append(loss.item())
        err = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-6)
        assert err <= 1e-3, f"step {step}: loss {losses[0]} vs FSDP2's {losses[1]}"
        worst["loss"] = max(worst["loss"], err)
        worst["grad"] = max(worst["grad"], worst_against_fsdp2(ours, theirs, "grad", placements, mesh["tp"], 2e-2,
                                                               f"step {step}, FSDP2+TP"))
        for o in opts:
            o.step()
            o.zero_grad()
    worst_against_fsdp2(ours, theirs, "value", placements, mesh["tp"], 1e-2, "after the steps, FSDP2+TP")
    return worst


def _position_init(module: nn.Module) -> None:
    """A deterministic initializer: each element's value from its position in the full
    tensor, written through the parameter's own placements (a misplaced shard shows)."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in module.named_parameters(recurse=False):
        full = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape).sin() * (1 + len(name))
        full = full.to(p.to_local().device if isinstance(p, DTensor) else p.device)
        with torch.no_grad():
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _position_built(device, tp_mesh, dp_mesh):
    """The model built on the device with the position init, parallelized with SP and
    sharded by ours; with its TP placements."""
    direct = build(device)
    direct.apply(_position_init)
    direct = parallelize(direct, tp_mesh, True)
    placements = placements_of(direct)
    shard_ours(direct, dp_mesh, {})
    return direct, placements


def tp_deferred_init(rank: int, world: int, shape: Tuple[int, ...]) -> None:
    """A model built on the meta device, parallelized there, sharded and materialized:
    equal to the TP model built on the device (same initializer), and it trains the same.
    reset_parameters() on DTensors works too (every element written)."""
    device = device_for_backend()
    mesh = make_mesh(shape)
    tp_mesh, dp_mesh = mesh["tp"], dp_mesh_of(mesh)
    direct, placements = _position_built(device, tp_mesh, dp_mesh)
    with torch.device("meta"):
        deferred = TPNet()
    parallelize(deferred, tp_mesh, True)
    shard_ours(deferred, dp_mesh, {})
    mfsdp.materialize(deferred, init_fn=_position_init)
    a, b = (full_of_ours(m, "value", placements, tp_mesh) for m in (direct, deferred))
    for n in a:
        assert torch.equal(a[n], b[n]), f"materialized '{n}' differs from the model built on the device"
    dp_index, dp_world = dp_rank_of(mesh)
    x, y = next(batches(1, 2, dp_world))
    outs = [m(x[2 * dp_index: 2 * dp_index + 2].to(device)) for m in (direct, deferred)]
    assert torch.equal(outs[0], outs[1]), "the materialized model computes differently"
    with torch.device("meta"):
        plain_init = TPNet()
    parallelize(plain_init, tp_mesh, False)
    plain_placements = placements_of(plain_init)
    shard_ours(plain_init, dp_mesh, {"strategy": "optim_grads"})
    mfsdp.materialize(plain_init)  # nn.Linear / LayerNorm reset_parameters on DTensors
    values = full_of_ours(plain_init, "value", plain_placements, tp_mesh)
    assert all(torch.isfinite(v).all() for v in values.values())
    F.mse_loss(plain_init(x[:2].to(device)), y[:2].to(device)).backward()


def _reset_all(model: nn.Module) -> None:
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def tp_to_empty_then_init(rank: int, world: int, shape: Tuple[int, ...]) -> None:
    """torchtitan's Trainer with TP: built on meta, parallelized, sharded, `to_empty`, then
    initialized in place. The random initializers (nn.Linear's kaiming_uniform_ with the
    global fan-in, LayerNorm's fills) give what the TP model alone gives from the same
    seed, every element written; a whole value copied in (the position init) lands where
    the model built on the device holds it; both then compute as those models do."""
    device = device_for_backend()
    mesh = make_mesh(shape)
    tp_mesh, dp_mesh = mesh["tp"], dp_mesh_of(mesh)
    dp_index, dp_world = dp_rank_of(mesh)
    x, _ = next(batches(1, 2, dp_world))
    x = x[2 * dp_index: 2 * dp_index + 2].to(device)

    with torch.device("meta"):
        alone = parallelize(TPNet(), tp_mesh, False)
    alone.to_empty(device=device)
    torch.manual_seed(SEED)
    _reset_all(alone)
    want = want_alone = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                         for n, p in alone.named_parameters()}
    # offload: the TP shards' pieces in host memory, the TP mesh on the device (the fills
    # run there, as DTensor's draws do, and each rank keeps its slice on the host)
    for sc in ({}, {"strategy": "optim_grads"}, {"offload": True}):
        with torch.device("meta"):
            model = parallelize(TPNet(), tp_mesh, False)
        placements = placements_of(model)
        shard_ours(model, dp_mesh, sc)
        model.to_empty(device=device)
        torch.manual_seed(SEED)
        _reset_all(model)
        got = full_of_ours(model, "value", placements, tp_mesh)
        for n, v in want.items():
            assert torch.equal(got[n], v.double().cpu()), f"{sc}: '{n}' after to_empty + reset_parameters differs " \
                f"from the TP model's (max diff {(got[n] - v.double().cpu()).abs().max():.3e})"
        assert torch.equal(model(x), alone(x)), f"{sc}: the initialized model computes differently"

    direct, placements = _position_built(device, tp_mesh, dp_mesh)
    with torch.device("meta"):
        deferred = parallelize(TPNet(), tp_mesh, True)
    shard_ours(deferred, dp_mesh, {})
    deferred.to_empty(device=device)
    deferred.apply(_position_init)  # plain tensors here: whole values copied into the sharded parameters
    a, b = (full_of_ours(m, "value", placements, tp_mesh) for m in (direct, deferred))
    for n in a:
        assert torch.equal(a[n], b[n]), f"'{n}' after to_empty + a whole value copied in differs from the model built"
    assert torch.equal(direct(x), deferred(x)), "the position-initialized model computes differently"

    # The TP model alone's DTensors copied in, parameter by parameter (replicated norm
    # weights that some ranks hold whole too: each rank once decided by its own piece), and
    # Lightning's per-module to_empty(recurse=False) before reset_parameters.
    alone_sp = parallelize(build(device), tp_mesh, True)
    with torch.device("meta"):
        copied = parallelize(TPNet(), tp_mesh, True)
    placements = placements_of(copied)
    shard_ours(copied, dp_mesh, {})
    copied.to_empty(device=device)
    sources = dict(alone_sp.named_parameters())
    with torch.no_grad():
        for name, p in copied.named_parameters():
            p.copy_(sources[name])
    got = full_of_ours(copied, "value", placements, tp_mesh)
    for name, p in sources.items():
        want = (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().cpu()
        assert torch.equal(got[name], want), f"'{name}' copied in from the TP model's DTensor differs"
    with torch.device("meta"):
        per_module = parallelize(TPNet(), tp_mesh, False)
    placements = placements_of(per_module)
    shard_ours(per_module, dp_mesh, {})
    for m in per_module.modules():  # Lightning's: only modules holding meta tensors themselves
        if any(p.is_meta for p in m.parameters(recurse=False)):
            m.to_empty(device=device, recurse=False)
    torch.manual_seed(SEED)
    _reset_all(per_module)
    got = full_of_ours(per_module, "value", placements, tp_mesh)
    for n, v in want_alone.items():
        assert torch.equal(got[n], v.double().cpu()), f"'{n}' after per-module to_empty + reset_parameters differs"


def tp_full_state_dict_roundtrip(rank: int, world: int, path: str) -> None:
    """full_state_dict gives global tensors equal to the plain model's; load_full_state_dict
    and load_safetensors of plain full values load exactly into a TP model; a parameter
    replaced by a full value keeps this rank's TP shard of it."""
    from safetensors.torch import save_file

    device = device_for_backend()
    mesh = make_mesh((2, 2))
    ref = build(device)
    model = shard_ours(parallelize(copy.deepcopy(ref), mesh["tp"], True), dp_mesh_of(mesh), {})
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v.cpu()), f"full_state_dict '{k}' differs from the plain model's"
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(-1.5)
    target = ref.state_dict()
    fresh = shard_ours(parallelize(build(device), mesh["tp"], True), dp_mesh_of(mesh), {})
    mfsdp.load_full_state_dict(fresh, target)
    got = mfsdp.full_state_dict(fresh, rank0_only=False)
    for k, v in target.items():
        assert torch.equal(got[k], v.cpu()), f"load_full_state_dict '{k}' did not load exactly"
    if rank == 0:
        save_file({k: v.contiguous().cpu() for k, v in target.items()}, f"{path}/model.safetensors")
    dist.barrier()
    fresh = shard_ours(parallelize(build(device), mesh["tp"], True), dp_mesh_of(mesh), {})
    mfsdp.load_safetensors(fresh, path)
    got = mfsdp.full_state_dict(fresh, rank0_only=False)
    for k, v in target.items():
        assert torch.equal(got[k], v.cpu()), f"load_safetensors '{k}' did not load exactly"
    fresh.blocks[0].w1.weight = nn.Parameter(target["blocks.0.w1.weight"].clone())
    x, _ = next(batches(1, 2, 2))
    with torch.no_grad():
        fresh(x[:2].to(device))  # the forward adopts the replaced parameter
    got = mfsdp.full_state_dict(fresh, rank0_only=False)
    assert torch.equal(got["blocks.0.w1.weight"], target["blocks.0.w1.weight"].cpu())


def tp_misuse(rank: int, world: int) -> None:
    """Misuse is refused naming the problem: a TP mesh over the data-parallel ranks or
    from another job mesh, a process group instead of the dp mesh, a dp mesh on the TP
    dim, uneven TP shards, TP parameters handed to the layer-wise optimizer."""
    device = device_for_backend()
    mesh = make_mesh((2, 2))
    # TP over the very ranks that shard the data: the dims overlap, so no (dp, tp) mesh exists.
    other = init_device_mesh(device.type, (2, 2), mesh_dim_names=("tp", "dp_other"))
    model = parallelize(build(device), other["tp"], False)
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=mesh["dp_shard"]), ValueError,
                 "shares a dimension", "w1.weight", f"ranks {[rank % 2, rank % 2 + 2]} in both")
    # TP ranks in another order than the job mesh lists them: orthogonal ranks, yet no mesh holds both.
    permuted = DeviceMesh(device.type, torch.tensor([[1, 0], [3, 2]]), mesh_dim_names=("dp_other", "tp"))
    model = parallelize(build(device), permuted["tp"], False)
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=mesh["dp_shard"]), ValueError,
                 "not dims of one job mesh", "w1.weight")
    model = parallelize(build(device), mesh["tp"], False)
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], process_group=mesh["dp_shard"].get_group()),
                 ValueError, "pass the data-parallel mesh", "w1.weight")
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=mesh["tp"]), ValueError, "shares a dimension")
    config = mfsdp.FSDPConfig()
    expect_error(lambda: mfsdp.fully_shard_model(model, config, device_mesh=mesh, dp_shard_dim="dp_shard",
                                                 tp_dim="dp_shard"), ValueError, "also names a data-parallel")
    expect_error(lambda: mfsdp.fully_shard_model(model, config, device_mesh=mesh), ValueError, "tp_dim=")
    expect_error(lambda: mfsdp.fully_shard_model(build(device), config, device_mesh=mesh, dp_shard_dim="dp_shard",
                                                 tp_dim="tp"), ValueError, "no parameter", "is a DTensor")

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 5)

    odd = Odd().to(device)
    parallelize_module(odd, mesh["tp"], {"lin": ColwiseParallel()})
    expect_error(lambda: mfsdp.fully_shard(odd, mesh=mesh["dp_shard"]), ValueError, "'lin.weight'", "unevenly",
                 "Shard(0)")
    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer

    expect_error(lambda: LayerwiseDistributedOptimizer(model.blocks[1], torch.optim.AdamW),
                 NotImplementedError, "w1.weight", "tensor parallel")


def tp_unnamed_meshes(rank: int, world: int) -> None:
    """TP with meshes without dim names (init_device_mesh without mesh_dim_names,
    DeviceMesh.from_group) raises a ValueError naming the problem, not torch's TypeError
    from joining unnamed meshes; FSDP2 accepts none of these setups either: TP and data
    parallelism over the same unnamed mesh, unnamed dp and tp meshes of the right ranks, a
    named dp mesh with an unnamed tp one."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    device = device_for_backend()
    named = make_mesh((2, 2))
    flat = init_device_mesh(device.type, (world,))
    dp_unnamed = DeviceMesh.from_group(named["dp_shard"].get_group(), device.type)
    tp_unnamed = DeviceMesh.from_group(named["tp"].get_group(), device.type)
    cases = [(flat, flat, ("shares a dimension", "(no dim names)", f"ranks {list(range(world))} in both")),
             (tp_unnamed, dp_unnamed, ("data-parallel and tensor-parallel meshes have no dim names",
                                       "mesh_dim_names=('dp_shard', 'tp')")),
             (tp_unnamed, named["dp_shard"], ("the tensor-parallel mesh has no dim names",))]
    for tp_mesh, dp_mesh, fragments in cases:
        model = parallelize(build(device), tp_mesh, False)
        expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=dp_mesh), ValueError, "'w1.weight'", *fragments)
        try:
            fsdp2_fully_shard(parallelize(build(device), tp_mesh, False).blocks[0], mesh=dp_mesh)
        except Exception:
            continue
        raise AssertionError(f"FSDP2 accepts TP on {tp_mesh} with dp mesh {dp_mesh}: so should fully_shard")


def llama_tp_parity(rank: int, world: int, shape: Tuple[int, ...], sp: bool, tie: bool, steps: int = 3) -> Dict:
    """The library's LlamaModel under its own tensor_parallel plan (head-major fused
    projections, tied embedding kept tied) and our fully_shard on the data-parallel dims:
    the same losses, gradients and parameters as the plain model on the whole batch."""
    from megatron_fsdp_ext.models import LlamaConfig, LlamaModel, tensor_parallel

    device = device_for_backend()
    mesh = make_mesh(shape)
    dp_index, dp_world = dp_rank_of(mesh)
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, tie_embeddings=tie)
    torch.manual_seed(SEED)
    ref = LlamaModel(cfg).to(device)
    model = tensor_parallel(copy.deepcopy(ref), mesh["tp"], sequence_parallel=sp)
    assert (model.head.weight is model.embed.weight) == tie
    placements = placements_of(model)
    for block in model.blocks:
        mfsdp.fully_shard(block, mesh=dp_mesh_of(mesh))
    mfsdp.fully_shard(model, mesh=dp_mesh_of(mesh))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    g = torch.Generator().manual_seed(3)
    per, worst = 2, {"loss": 0.0, "grad": 0.0}
    for step in range(steps):
        data = torch.randint(0, cfg.vocab_size, (dp_world * per, 17), generator=g)
        tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
        rows = slice(dp_index * per, (dp_index + 1) * per)
        loss = model.loss(tokens[rows], targets[rows])
        loss.backward()
        ref_loss = ref.loss(tokens, targets)
        ref_loss.backward()
        losses = [None] * world
        dist.all_gather_object(losses, loss.item())
        err = abs(sum(losses) / world - ref_loss.item()) / ref_loss.item()
        assert err <= 1e-5, f"step {step}: loss {sum(losses) / world} vs {ref_loss.item()}"
        worst["loss"] = max(worst["loss"], err)
        ours = full_of_ours(model, "grad", placements, mesh["tp"])
        for name, p in ref.named_parameters():
            e = rel_err(ours[name].reshape(p.shape), p.grad)
            assert e <= 1e-4, f"step {step}: gradient of '{name}' rel err {e:.3e}"
            worst["grad"] = max(worst["grad"], e)
        norm, ref_norm = mfsdp.clip_grad_norm_(model, 0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert rel_err(norm, ref_norm) <= 1e-5, f"clip norm {norm.item()} vs {ref_norm.item()}"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return worst


def tp_hsdp_state_dicts(rank: int, world: int, path: str) -> Dict:
    """HSDP x TP (replicate2 x dp2 x tp2, world 8): model and optimizer state dicts equal
    FSDP2's on the same 3-D mesh (Replicate, the strided or plain dp Shard, TP's placement),
    and a DCP checkpoint of it loads into a 4 x 2 (dp x tp) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict)

    device = device_for_backend()
    mesh = make_mesh((2, world // 4, 2))
    models = []
    for system in ("ours", "fsdp2"):
        model = parallelize(build(device), mesh["tp"], True)
        (shard_fsdp2 if system == "fsdp2" else lambda m, d: shard_ours(m, d, {}))(model, dp_mesh_of(mesh))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _step(model, opt, *dp_rank_of(mesh))
        models.append((model, opt))
    (ours, ours_opt), (theirs, theirs_opt) = models
    msd = get_model_state_dict(ours)
    report = {"model_entries": _same_dtensors(msd, get_model_state_dict(theirs), "HSDP x TP model state dict",
                                              tol=1e-5),
              "optim_entries": _same_dtensors(_flat_optim(get_optimizer_state_dict(ours, ours_opt)),
                                              _flat_optim(get_optimizer_state_dict(theirs, theirs_opt)),
                                              "HSDP x TP optimizer state dict", tol=1e-4)}
    assert all(v.device_mesh.ndim == 3 and v.placements[0] == Replicate() for v in msd.values() if v.dim() > 0)
    want = _full(msd)
    dcp.save({"model": msd}, checkpoint_id=f"{path}/hsdp_tp")
    flat_mesh = make_mesh((world // 2, 2))
    other = shard_ours(parallelize(build(device), flat_mesh["tp"], True), dp_mesh_of(flat_mesh), {})
    sd = {"model": get_model_state_dict(other)}
    dcp.load(sd, checkpoint_id=f"{path}/hsdp_tp")
    set_model_state_dict(other, sd["model"])
    got = _full(get_model_state_dict(other))
    for k, v in want.items():
        assert rel_err(got[k], v) <= 1e-5, f"HSDP x TP -> {world // 2} x 2: '{k}' differs"
    return report


def tp_no_shard_data_replacement_refused(rank: int, world: int) -> None:
    """no_shard (no cast) with TP: the unit's DTensor parameters view its shard itself, so
    `p.data = x` (which moves the shard to new storage) is refused by name on any of its
    parameters, before anything changes; in-place writes and `p.data = p.data` still work,
    and the model trains as one plain process."""
    mesh = make_mesh((1, world))
    tp_mesh, dp_mesh = mesh["tp"], dp_mesh_of(mesh)
    ref = build(device_for_backend(), n_blocks=1)
    model = parallelize(copy.deepcopy(ref), tp_mesh, False)
    placements = placements_of(model)  # the reference's parameters
    # an empty parameter too: every empty tensor's data pointer is null, yet a new one
    # assigned moves the shard as well
    model.blocks[0].extra = nn.Parameter(torch.empty(0, device=device_for_backend()))
    shard_ours(model, dp_mesh, {"strategy": "no_shard"}, mesh)
    from megatron_fsdp_ext.core.dtensor_face import local_shape

    block = model.blocks[0]
    for p in (block.norm.weight, block.w1.weight, block.extra):  # plain, TP and empty parameters of the unit
        value = torch.zeros(local_shape(p), dtype=p.dtype, device=p.device)
        expect_error(lambda: setattr(p, "data", value), NotImplementedError, "no_shard", "p.copy_(x)")
    block.norm.weight.data = block.norm.weight.data  # the same storage: nothing moves
    with torch.no_grad():
        block.norm.weight.copy_(block.norm.weight.detach() * 1.0)
    x, y = next(batches(1, 2, 1))
    F.mse_loss(model(x.to(device_for_backend())), y.to(device_for_backend())).backward()
    F.mse_loss(ref(x.to(device_for_backend())), y.to(device_for_backend())).backward()
    grads = full_of_ours(model, "grad", placements, tp_mesh)
    for name, p in ref.named_parameters():
        assert rel_err(grads[name].reshape(p.shape), p.grad) <= 1e-5, f"gradient of '{name}' differs"
    block.extra.data = block.extra.data  # an empty piece assigned to itself: nothing moves
