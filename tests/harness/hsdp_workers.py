"""Hybrid sharding (fully_shard on a 2-D (replicate, shard) DeviceMesh) against a plain
single-process model: gradients, clipped norms and parameters per step, for every
strategy, with the all-reduce across replicas deferred under gradient accumulation; and
checkpoints that move between HSDP and 1-D FSDP layouts."""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.dcp import load_checkpoint, save_checkpoint
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.core.param_index import iter_states

from .observe import count_collectives
from .workers import _full, device_for_backend, expect_error, flat_piece, rel_err, shard_piece, unique_storage_bytes

SEED = 1234
CFG = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, ffn_hidden=72)


def _mesh(replicate: int, shard: int):
    return init_device_mesh(device_for_backend().type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def _build(device, tie: bool = False) -> LlamaModel:
    torch.manual_seed(SEED)
    return LlamaModel(LlamaConfig(**CFG, tie_embeddings=tie)).to(device)


def _shard(model, mesh, strategy: str, mp=None, **extra):
    kw = dict(mesh=mesh, sharding_strategy=strategy, **extra)
    if mp is not None:
        kw["mp_policy"] = mp
    for block in model.blocks:
        mfsdp.fully_shard(block, **kw)
    return mfsdp.fully_shard(model, **kw)


def _full_grads(model) -> Dict[str, torch.Tensor]:
    """Full gradients assembled from every rank's shard pieces; checks on the way that
    every replica of a piece holds the same values (the all-reduce across replicas ran)."""
    local = {}
    for name, p in model.named_parameters():
        state, idx, piece = shard_piece(p)
        g = flat_piece(p.grad).double().cpu() if p.grad is not None else None
        local[name] = (piece.param_offset, state.unit.layout.numels[idx], g)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    full = {}
    for name, (_, numel, _) in local.items():
        out = torch.full((numel,), float("nan"), dtype=torch.float64)
        for r, by_rank in enumerate(every):
            offset, _, g = by_rank[name]
            assert g is not None, f"rank {r}: no gradient for '{name}'"
            seen = out[offset: offset + g.numel()]
            known = ~torch.isnan(seen)
            assert torch.equal(seen[known], g[known]), (
                f"'{name}': replicas disagree on gradient elements [{offset}, {offset + g.numel()}) (rank {r})")
            seen.copy_(g)
        assert not torch.isnan(out).any(), f"'{name}': gradient pieces do not cover the parameter"
        full[name] = out
    return full


def _batches(steps: int, micro: int, per: int, world: int, seq: int = 8):
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        data = torch.randint(0, CFG["vocab_size"], (micro * world * per, seq + 1), generator=g)
        yield data[:, :-1], data[:, 1:]


def hsdp_parity(rank: int, world: int, replicate: int, scenarios: List[Dict]) -> List[Dict]:
    """For each scenario: HSDP on a (replicate, world // replicate) mesh trains like the
    plain model on the whole batch. Scenario keys: strategy, micro (micro-batches per
    step), defer (set_requires_all_reduce(False) on all but the last micro-batch), clip."""
    device = device_for_backend()
    mesh = _mesh(replicate, world // replicate)
    shard_rank = mesh.get_local_rank(1)
    results = []
    for sc in scenarios:
        strategy, micro, defer, clip = sc["strategy"], sc.get("micro", 1), sc.get("defer", False), sc.get("clip")
        ref = _build(device)
        if sc.get("config"):  # Megatron's spelling: FSDPConfig + fully_shard_model with named mesh dims
            model = mfsdp.fully_shard_model(
                copy.deepcopy(ref), mfsdp.FSDPConfig(data_parallel_sharding_strategy=strategy),
                fsdp_unit_modules=[type(ref.blocks[0])], device_mesh=mesh, dp_shard_dim="shard",
                dp_outer_dim="replicate")
        else:  # groups of their own: timeout= or create_all_gather_group=True, made for every shard group
            extra = {k: sc[k] for k in ("timeout", "create_all_gather_group", "gather_bucket_bytes",
                                        "reduce_bucket_bytes") if k in sc}
            model = _shard(copy.deepcopy(ref), mesh, strategy, **extra)
        units = [s for s in iter_states(model) if s.unit is not None]
        assert all(s.unit.replicate_size == replicate and s.unit.world_size == world // replicate for s in units)
        assert all(s.unit.replicate_rank == mesh.get_local_rank(0) for s in units)
        # Units shard over this rank's row of the mesh (a group made for another row would
        # reduce across the wrong ranks: the gradient checks below catch that).
        shard_ranks = mesh.mesh[mesh.get_local_rank(0)].tolist()
        assert all(dist.get_process_group_ranks(s.process_group) == shard_ranks for s in units)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        per, worst = 2, 0.0
        for step, (tokens, targets) in enumerate(_batches(3, micro, per, world)):
            with count_collectives() as seen:
                for m in range(micro):
                    last = m == micro - 1
                    if defer:
                        model.set_requires_all_reduce(last)
                    rows = slice((m * world + rank) * per, (m * world + rank + 1) * per)
                    (model.loss(tokens[rows].to(device), targets[rows].to(device)) / micro).backward()
                    ref_rows = slice(m * world * per, (m + 1) * world * per)
                    (ref.loss(tokens[ref_rows].to(device), targets[ref_rows].to(device)) / micro).backward()
                    if defer and not last and replicate > 1:
                        assert all(s.unit.has_partial_reduction for s in units), "all-reduce was not deferred"
                        if step == 0:
                            assert all(p.grad is None for p in model.parameters()), \
                                "a deferred reduction landed a gradient"
            assert not any(s.unit.has_partial_reduction for s in units), "a deferred reduction was never all-reduced"
            want_all_reduces = (1 if defer else micro) * len(units) if replicate > 1 else 0
            got = seen.get("all_reduce_replicas", 0)
            assert got == want_all_reduces, f"step {step}: {got} all-reduces across replicas, expected {want_all_reduces}"
            ours = _full_grads(model)
            for name, p in ref.named_parameters():
                err = rel_err(ours[name], flat_piece(p.grad))
                assert err <= sc.get("tol", 1e-5), f"{sc} step {step}: gradient of '{name}' rel err {err:.3e}"
                worst = max(worst, err)
            if clip is not None:
                norm = mfsdp.clip_grad_norm_(model, clip)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                assert rel_err(norm, ref_norm) <= sc.get("tol", 1e-5), f"clip norm {norm.item()} vs {ref_norm.item()}"
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        full = mfsdp.full_state_dict(model, rank0_only=False)
        param_err = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
        assert param_err <= sc.get("tol", 1e-5), f"{sc}: parameters after 3 steps: rel err {param_err}"
        results.append({"scenario": sc, "shard_rank": shard_rank, "grad_err": worst, "param_err": param_err})
    return results


def _train(model, opt, steps: int, rank: int, world: int) -> None:
    device = device_for_backend()
    for tokens, targets in _batches(steps, 1, 2, world):
        rows = slice(rank * 2, rank * 2 + 2)
        model.loss(tokens[rows].to(device), targets[rows].to(device)).backward()
        opt.step()
        opt.zero_grad()


def _same_state(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ {sorted(set(a) ^ set(b))}"
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), f"{what}: '{k}' differs"


def _funcol_crashes() -> bool:
    """torch's full state dicts gather DTensors with its functional collectives, which
    crash with CUDA tensors on Gloo (torch 2.11: SIGSEGV): there the sharded state dicts
    are gathered by workers._full instead (plain collectives)."""
    return dist.get_backend() == "gloo" and device_for_backend().type == "cuda"


def _full_model(model) -> Dict[str, torch.Tensor]:
    if _funcol_crashes():
        return {k: _full(v) for k, v in get_model_state_dict(model).items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _full_optim(model, opt) -> Dict[str, torch.Tensor]:
    full = not _funcol_crashes()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))
    return {f"{p}.{k}": v if full else _full(v) for p, st in osd["state"].items() for k, v in st.items()
            if torch.is_tensor(v)}


def hsdp_checkpoints(rank: int, world: int, path: str) -> None:
    """HSDP 2x(world/2) trains and saves (torch DCP through the state-dict helpers, and our
    save_checkpoint); 1-D FSDP over all ranks and HSDP (world x 1) load both and hold the
    same parameters and optimizer state; a plain model loads torch's checkpoint alone."""
    device = device_for_backend()
    hsdp = _shard(_build(device), _mesh(2, world // 2), "optim_grads_params")
    opt = torch.optim.AdamW(hsdp.parameters(), lr=1e-2)
    _train(hsdp, opt, 2, rank, world)
    sd = get_model_state_dict(hsdp)
    some = next(iter(sd.values()))
    assert some.device_mesh.ndim == 2 and some.placements[0].is_replicate() and some.placements[1].is_shard(0), \
        f"HSDP state dict placements {some.placements}"
    want_params = _full_model(hsdp)
    want_optim = _full_optim(hsdp, opt)
    dcp.save({"model": sd, "optimizer": get_optimizer_state_dict(hsdp, opt)}, checkpoint_id=f"{path}/torch")
    save_checkpoint(f"{path}/ours", hsdp, opt)

    for name, make in (("fsdp", lambda: _shard(_build(device), _mesh(1, world), "optim_grads_params")),
                       ("hsdp_replicate_all", lambda: _shard(_build(device), _mesh(world, 1), "optim_grads")),
                       ("fsdp_1d_group", lambda: _shard(_build(device), None, "optim_grads_params"))):
        for fmt in ("torch", "ours"):
            model = make()
            o = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, o, 1, rank, world)  # optimizer state exists and differs from the saved one
            if fmt == "torch":
                target = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, o)}
                dcp.load(target, checkpoint_id=f"{path}/torch")
                set_model_state_dict(model, target["model"])
                set_optimizer_state_dict(model, o, target["optimizer"])
            else:
                load_checkpoint(f"{path}/ours", model, o)
            _same_state(_full_model(model), want_params,
                        f"{name} loading {fmt}'s checkpoint: parameters")
            _same_state(_full_optim(model, o), want_optim, f"{name} loading {fmt}'s checkpoint: optimizer state")
    # Full state dicts load into HSDP too: every rank passing it, or rank 0 streaming it.
    for broadcast in (False, True):
        model = _shard(_build(device), _mesh(2, world // 2), "optim_grads")
        given = want_params if (rank == 0 or not broadcast) else None
        mfsdp.load_full_state_dict(model, given, broadcast_from_rank0=broadcast)
        _same_state(mfsdp.full_state_dict(model, rank0_only=False), want_params,
                    f"HSDP load_full_state_dict(broadcast_from_rank0={broadcast})")
    # Deferred init under HSDP: every replica materializes the same values, those of a direct build.
    with torch.device("meta"):
        meta = LlamaModel(LlamaConfig(**CFG))
    _shard(meta, _mesh(2, world // 2), "optim_grads_params")
    torch.manual_seed(SEED)
    mfsdp.materialize(meta)
    # Built directly on the device the shards live on: its random number generator (CUDA's
    # on a GPU) is the one materialize runs the initializers with.
    torch.manual_seed(SEED)
    with torch.device(device):
        direct = LlamaModel(LlamaConfig(**CFG))
    _same_state(mfsdp.full_state_dict(meta, rank0_only=False), direct.state_dict(),
                "HSDP materialize against a direct build")
    dist.barrier()
    if rank == 0:  # one process, no sharding at all
        plain = _build(device)
        target = {"model": plain.state_dict()}
        dcp.load(target, checkpoint_id=f"{path}/torch", no_dist=True)
        _same_state(target["model"], want_params, "a plain model loading the HSDP checkpoint")
    dist.barrier()


def hsdp_errors(rank: int, world: int) -> None:
    """Misuse of the mesh argument is refused with messages that name it."""
    mesh = _mesh(2, world // 2)
    model = _build(device_for_backend())
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=mesh, process_group=dist.group.WORLD),
                 ValueError, "either mesh or process_group")
    mesh3 = init_device_mesh(device_for_backend().type, (1, 2, world // 2))
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh=mesh3), ValueError, "3-D mesh", "(replicate, shard)")
    expect_error(lambda: mfsdp.fully_shard(model.blocks[0], mesh="not a mesh"), TypeError, "DeviceMesh")
    expect_error(lambda: mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(), device_mesh=mesh), ValueError,
                 "name the shard dimension", "dp_shard_dim")
    expect_error(lambda: mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(), device_mesh=mesh, dp_shard_dim="dp"),
                 ValueError, "dp_shard_dim='dp' is not a dimension")
    expect_error(lambda: mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(), device_mesh=mesh,
                                                 dp_outer_dim="replicate"), ValueError, "needs dp_shard_dim")
    expect_error(lambda: mfsdp.FSDPConfig(outer_dp_sharding_strategy="optim"), NotImplementedError,
                 "outer_dp_sharding_strategy='optim'")
    if world == 4:  # rows not ascending would pair the wrong replicas
        from torch.distributed.device_mesh import DeviceMesh
        shuffled = DeviceMesh(device_for_backend().type, torch.tensor([[0, 1], [3, 2]]),
                              mesh_dim_names=("replicate", "shard"))
        expect_error(lambda: mfsdp.fully_shard(model.blocks[1], mesh=shuffled), ValueError, "ascending order")
    mfsdp.fully_shard(model, mesh=mesh)
    expect_error(lambda: model.set_requires_all_reduce(0), TypeError, "set_requires_all_reduce expects a bool")


def _freeze_some(model) -> None:
    """Part of a block and the root: units that are partly frozen."""
    model.blocks[1].attn.wqkv.weight.requires_grad_(False)
    model.norm.weight.requires_grad_(False)


def estimate_matches_what_units_hold(rank: int, world: int, strategy: str, bf16: bool, frozen: bool = False) -> Dict:
    """estimate_memory on a meta model equals, component by component, the bytes the
    sharded model really holds (largest over ranks): shards, gradients after backward,
    optimizer state after a step, gathered parameters (kept copies, or ZeRO-3's replayed
    peak of unsharded bytes); with partly frozen units too; and estimate_memory on the
    model once sharded gives the same."""
    from .observe import UnitTrace

    device = device_for_backend()
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    with torch.device("meta"):
        meta = LlamaModel(LlamaConfig(**{**CFG, "n_layers": 3}))
    if frozen:
        _freeze_some(meta)
    block = type(meta.blocks[0])
    est = mfsdp.estimate_memory(meta, world, unit_modules=[block], sharding_strategy=strategy, mp_policy=mp,
                                optimizer="adamw")
    torch.manual_seed(SEED)
    model = LlamaModel(LlamaConfig(**{**CFG, "n_layers": 3})).to(device)
    if frozen:
        _freeze_some(model)
    mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(data_parallel_sharding_strategy=strategy, bf16=bf16,
                                                    grad_reduce_in_fp32=bf16), fsdp_unit_modules=[block])
    # estimate_memory's default budgets (0: no buckets) against the same held by the model.
    model.set_gather_bucket_bytes(0)
    model.set_reduce_bucket_bytes(0)
    states = [s for s in iter_states(model) if s.unit is not None]
    assert est.num_units == len(states), (est.num_units, len(states))
    again = mfsdp.estimate_memory(model, world, unit_modules=block, sharding_strategy=strategy, mp_policy=mp,
                                  optimizer="adamw")  # sharded now: 1-D shards, their units know full shapes
    assert again == est, f"estimate_memory on the sharded model: {again} != on its meta twin: {est}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG["vocab_size"], (2, 8), device=device)
    root = model._fsdp_state
    model.loss(tokens, tokens).backward()  # the first step records the order prefetch follows
    opt.step()
    opt.zero_grad()
    with UnitTrace(states) as trace:
        model.loss(tokens, tokens).backward()
    held = {
        "params": sum(s.unit.sharded_flat.nbytes for s in states),
        "grads": unique_storage_bytes(p.grad for p in model.parameters()),
    }
    opt.step()
    held["optimizer_state"] = sum(v.nbytes for st in opt.state.values() for v in st.values()
                                  if torch.is_tensor(v) and v.dim() > 0)
    if strategy in ("optim", "optim_grads") or strategy == "no_shard":
        model(tokens)  # kept copies are gathered (again) after the step
        held["gathered_params"] = sum(s.unit.unsharded_nbytes for s in states)
    else:
        peak = trace.max_unsharded(weight=lambda s: s.unit.unsharded_nbytes)
        held["gathered_params"] = max(peak.values())
    largest = [None] * world
    dist.all_gather_object(largest, held)
    for key in held:
        most = max(h[key] for h in largest)
        assert getattr(est, key) == most, (
            f"{strategy} bf16={bf16}: estimate_memory {key} = {getattr(est, key)} bytes, the units hold {most}")
    assert est.reduction_buffers > 0 and est.total > sum(held.values())
    return {"estimate": str(est), "held": held, "root_gathered": root.unit.unsharded_nbytes}
