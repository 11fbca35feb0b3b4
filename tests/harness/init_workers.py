"""Distributed test bodies for deferred (meta-device) init and for loading full weights
into a model that never existed in full: the values must equal those of the model built
directly on the device with the same seed (the independent reference), and training
from them must match it, gradients included.

Workers run under run_distributed on Gloo (CPU) and NCCL (GPU) alike.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.core.param_index import iter_states

from .workers import (check_grads, device_for_backend, expect_error, global_batches, rel_err, shard_blocks_and_root,
                      shard_piece)

SEED = 1234


def _cfg(opts: Dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, d_model=32, n_layers=opts.get("layers", 3), n_heads=4, ffn_hidden=88,
                       tie_embeddings=opts.get("tie", False))


def _reference(cfg: LlamaConfig, device) -> LlamaModel:
    """The model built directly on the device, as a user without deferred init would."""
    torch.manual_seed(SEED)
    with torch.device(device):
        return LlamaModel(cfg)


def _meta_sharded(cfg: LlamaConfig, opts: Dict) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(cfg)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=opts.get("param_dtype"), reduce_dtype=opts.get("reduce_dtype"))
    return shard_blocks_and_root(model, sharding_strategy=opts.get("strategy", "optim_grads_params"), mp_policy=mp)


def check_local_shards(model: nn.Module, ref: nn.Module) -> int:
    """Every local shard equals its slice of the reference's parameter, bit for bit."""
    checked = 0
    for name, p in model.named_parameters():
        _, _, piece = shard_piece(p)
        want = ref.get_parameter(name).detach().reshape(-1)[piece.param_offset: piece.param_offset + piece.numel]
        assert p.detach().shape == want.shape and torch.equal(p.detach(), want), (
            f"'{name}': local shard differs from the directly built model's slice "
            f"(max abs diff {(p.detach().float() - want.float()).abs().max().item():.3e})")
        checked += piece.numel
    return checked


def deferred_init_parity(rank: int, world: int, opts: Dict) -> Dict:
    """Meta build, fully_shard, materialize: shards hold exactly the reference's values;
    nothing works before materialize; two training steps then match the reference
    (gradients and parameters)."""
    device = device_for_backend()
    cfg = _cfg(opts)
    ref = _reference(cfg, device)
    model = _meta_sharded(cfg, opts)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    for p in model.parameters():
        assert p.device == device and p.detach().dim() == 1, f"shard on {p.device}, {p.detach().dim()}-D"
        assert p.detach().numel() == 0 or bool(torch.isnan(p).all()), "a deferred shard must hold NaN until materialized"
    expect_error(lambda: model(tokens), RuntimeError, "meta device", "materialize")
    expect_error(lambda: mfsdp.full_state_dict(model), RuntimeError, "meta device", "materialize")
    # FSDP2's meta DTensors: the layout of the values to come, none of them yet.
    assert all(v.is_meta for v in model.state_dict().values())

    torch.manual_seed(SEED)
    assert mfsdp.materialize(model) is model
    checked = check_local_shards(model, ref)
    expect_error(lambda: mfsdp.materialize(model), ValueError, "nothing to initialize")

    # Training from the materialized values is training from the reference's.
    replicated = opts.get("strategy") == "no_shard"
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    per = 2
    tol = 2e-2 if opts.get("param_dtype") is not None else 1e-5
    grad_err = 0.0
    for step, (tokens, targets) in enumerate(global_batches(cfg, 2, per * world, 8, device)):
        model.loss(tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]).backward()
        ref.loss(tokens, targets).backward()
        grad_err = max(grad_err, check_grads(step, model, ref, replicated, tol))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = mfsdp.full_state_dict(model, rank0_only=False)
    param_err = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert param_err <= tol, f"parameters after 2 steps from materialized values: rel err {param_err}"
    return {"checked_elements": checked, "grad_err": grad_err, "param_err": param_err}


def init_one_module_at_a_time(rank: int, world: int) -> Dict:
    """While a module's initializer runs, only that module's own parameters are full
    size: every other parameter of the model is still its rank's 1-D shard."""
    device = device_for_backend()
    cfg = _cfg({})
    ref = _reference(cfg, device)
    model = _meta_sharded(cfg, {})
    largest = [0]

    def init_fn(module):
        own = {id(p) for p in module.parameters(recurse=False)}
        for name, p in model.named_parameters():
            if id(p) not in own:
                assert p.detach().dim() == 1 and hasattr(p, "_mfsdp_owner"), (
                    f"'{name}' is full size while '{type(module).__name__}' initializes")
        largest[0] = max(largest[0], sum(p.numel() for p in module.parameters(recurse=False)))
        module.reset_parameters()

    torch.manual_seed(SEED)
    mfsdp.materialize(model, init_fn=init_fn)
    check_local_shards(model, ref)
    biggest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in ref.modules())
    assert largest[0] == biggest_module, (largest[0], biggest_module)
    return {"largest_module_numel": largest[0]}


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


class _Skips(nn.Linear):
    def reset_parameters(self):
        with torch.no_grad():
            self.weight[0].zero_()  # the other rows stay unset


class _Parent(nn.Module):
    """Initializes its child's parameter from its own reset_parameters (not allowed)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.child = nn.Linear(4, 4)

    def reset_parameters(self):
        with torch.no_grad():
            self.scale.fill_(1.0)
            self.child.weight.fill_(0.5)


class _MetaBuffer(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("table", torch.arange(4.0))


def deferred_init_errors(rank: int, world: int) -> None:
    """Every misuse of deferred init is refused with an error naming the module or tensor."""
    def sharded(build):
        with torch.device("meta"):
            m = build()
        return mfsdp.fully_shard(m)

    m = sharded(lambda: nn.Sequential(nn.Linear(4, 4), _NoReset()))
    expect_error(lambda: mfsdp.materialize(m), ValueError, "'1'", "_NoReset", "no reset_parameters", "init_fn")
    m = sharded(lambda: nn.Sequential(_Skips(4, 4)))
    expect_error(lambda: mfsdp.materialize(m), RuntimeError, "'0.weight'", "unset")
    m = sharded(_Parent)
    expect_error(lambda: mfsdp.materialize(m), RuntimeError, "_Parent", "does not hold directly")
    m = sharded(lambda: nn.Sequential(_MetaBuffer()))
    expect_error(lambda: mfsdp.materialize(m), RuntimeError, "buffer '0.table'", "unset")
    m = sharded(lambda: nn.Linear(4, 4))
    expect_error(lambda: mfsdp.materialize(m, init_fn=3), TypeError, "init_fn must be callable")

    def fix_buffer(module):
        module.reset_parameters()
        if isinstance(module, _MetaBuffer):
            module.table.copy_(torch.arange(4.0))

    # With an init_fn that sets the buffer, the same model materializes.
    m = sharded(lambda: nn.Sequential(_MetaBuffer()))
    mfsdp.materialize(m, init_fn=fix_buffer)
    assert torch.equal(m[0].table, torch.arange(4.0, device=m[0].table.device))

    # A real (non-meta) model has nothing to materialize: re-running initializers would
    # overwrite trained values.
    real = mfsdp.fully_shard(nn.Linear(4, 4).to(device_for_backend()))
    expect_error(lambda: mfsdp.materialize(real), ValueError, "nothing to initialize")
    # One unit cannot mix meta and real parameters.
    mixed = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 4).to(device_for_backend()))
    expect_error(lambda: mfsdp.fully_shard(mixed), ValueError, "'0.weight' is on the meta device", "'1.weight'")
    for state in iter_states(m):
        assert state.param_init.name == "MATERIALIZED"


# ---------------------------------------------------------------- loading full weights

class _WithBuffers(nn.Module):
    """Parameters in a unit plus persistent float and integer buffers (BatchNorm)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def load_into_meta_model(rank: int, world: int, opts: Dict) -> Dict:
    """A model that never existed in full loads a plain PyTorch state dict (on the CPU,
    given on every rank or only on rank 0 and streamed): shards equal the source's
    slices, buffers are real, and forward matches the source."""
    device = device_for_backend()
    broadcast = opts.get("broadcast", False)
    cfg = _cfg(opts)
    torch.manual_seed(SEED + 1)
    source = LlamaModel(cfg).to(device)
    sd = {k: v.detach().cpu().clone() for k, v in source.state_dict().items()}
    model = _meta_sharded(cfg, opts)
    mfsdp.load_full_state_dict(model, sd if rank == 0 or not broadcast else None, broadcast_from_rank0=broadcast)
    check_local_shards(model, source)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        err = rel_err(model(tokens), source(tokens))
    assert err <= 1e-5, f"forward after loading into a meta model: rel err {err}"

    # Buffers: a meta BatchNorm's running stats (and its int64 counter) are loaded too.
    torch.manual_seed(SEED + 2)
    plain = _WithBuffers().to(device)
    plain.train()
    plain(torch.randn(16, 8, device=device))  # running stats away from their init
    plain.eval()
    with torch.device("meta"):
        meta = _WithBuffers()
    mfsdp.fully_shard(meta.lin)
    mfsdp.fully_shard(meta)
    psd = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
    mfsdp.load_full_state_dict(meta, psd if rank == 0 or not broadcast else None, broadcast_from_rank0=broadcast)
    meta.eval()
    for name, b in plain.named_buffers():
        got = meta.get_buffer(name)
        assert got.device == device and torch.equal(got, b), f"buffer '{name}' not loaded"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        assert rel_err(meta(x), plain(x)) <= 1e-6
    return {"forward_err": err}


def load_into_meta_model_errors(rank: int, world: int) -> None:
    device = device_for_backend()
    cfg = _cfg({})
    torch.manual_seed(SEED)
    sd = {k: v.detach().cpu() for k, v in LlamaModel(cfg).state_dict().items()}
    model = _meta_sharded(cfg, {})
    partial = {k: v for k, v in sd.items() if k != "blocks.1.mlp.w_down.weight"}
    expect_error(lambda: mfsdp.load_full_state_dict(model, partial, strict=False), KeyError,
                 "'blocks.1.mlp.w_down.weight'", "meta device")
    expect_error(lambda: mfsdp.load_full_state_dict(model, None), TypeError, "state_dict is None")
    expect_error(lambda: mfsdp.load_full_state_dict(model, None, broadcast_from_rank0=True), TypeError,
                 "rank 0 must pass the full state dict")
    # Nothing was loaded by the refused calls: the model is still deferred.
    expect_error(lambda: model(torch.zeros(1, 4, dtype=torch.long, device=device)), RuntimeError, "materialize")

    class _Rope(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    with torch.device("meta"):
        rope = _Rope()
    mfsdp.fully_shard(rope)
    plain = {k: torch.zeros(v.shape) for k, v in _Rope().state_dict().items()}
    expect_error(lambda: mfsdp.load_full_state_dict(rope, plain), KeyError, "'inv_freq'", "materialize(model) first")


def load_safetensors_into_meta_model(rank: int, world: int, opts: Dict, directory: str) -> Dict:
    """A plain model saved as safetensors (two files, the tied head left out as Hugging
    Face does, optionally in bf16) loads into a model built on the meta device: shards
    equal the saved values, and forward matches the saved model."""
    from safetensors.torch import save_file
    import torch.distributed as dist

    device = device_for_backend()
    cfg = _cfg(opts)
    torch.manual_seed(SEED + 3)
    source = LlamaModel(cfg).to(device)
    dtype = opts.get("file_dtype", torch.float32)
    sd = {k: v.detach().to(dtype).cpu().contiguous() for k, v in source.state_dict().items()}
    if cfg.tie_embeddings:
        del sd["head.weight"]  # one tensor, one name
    if rank == 0:
        keys = sorted(sd)
        half = len(keys) // 2
        save_file({k: sd[k] for k in keys[:half]}, f"{directory}/model-00001-of-00002.safetensors")
        save_file({k: sd[k] for k in keys[half:]}, f"{directory}/model-00002-of-00002.safetensors")
    dist.barrier()
    with torch.no_grad():  # what the files hold, as the model's dtype
        for p in source.parameters():
            p.copy_(p.to(dtype))
    model = _meta_sharded(cfg, opts)
    mfsdp.load_safetensors(model, directory)
    check_local_shards(model, source)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        err = rel_err(model(tokens), source(tokens))
    assert err <= 1e-5, f"forward after load_safetensors: rel err {err}"

    # Misuse: a missing file, a missing key (strict), a key of the wrong shape.
    expect_error(lambda: mfsdp.load_safetensors(model, f"{directory}/nope"), FileNotFoundError, "nope")
    if rank == 0:
        bad = dict(sd)
        bad.pop("norm.weight")
        save_file(bad, f"{directory}/../missing.safetensors")
        bad = dict(sd, **{"norm.weight": torch.zeros(3, dtype=dtype)})
        save_file(bad, f"{directory}/../wrong.safetensors")
    dist.barrier()
    expect_error(lambda: mfsdp.load_safetensors(model, f"{directory}/../missing.safetensors"), KeyError,
                 "missing keys", "norm.weight")
    expect_error(lambda: mfsdp.load_safetensors(model, f"{directory}/../wrong.safetensors"), ValueError,
                 "'norm.weight' has shape (3,)")
    return {"forward_err": err}


# ---------------------------------------------------------------- GPU memory bounds

def _module_full_bytes(model: nn.Module) -> int:
    """The largest full size (bytes, original dtype) of one module's own parameters."""
    from megatron_fsdp_ext.core.param_index import owner_of

    largest = 0
    for m in model.modules():
        total = 0
        for p in m.parameters(recurse=False):
            state, i = owner_of(p)
            total += state.unsharded_params[i].numel() * p.element_size() if state is not None else 0
        largest = max(largest, total)
    return largest


def deferred_init_memory(rank: int, world: int) -> Dict:
    """Allocator peaks (CUDA) while a model that does not exist in full is sharded,
    materialized, loaded from rank 0's CPU dict and from safetensors: never more than the
    local shards, one module's (or parameter's) full size and a small constant."""
    import shutil
    import tempfile

    import torch.distributed as dist
    from safetensors.torch import save_file

    device = device_for_backend()
    assert device.type == "cuda", "allocator peaks are measured on CUDA"
    mib = 2 ** 20
    cfg = LlamaConfig(vocab_size=32000, d_model=1024, n_layers=6, n_heads=16, ffn_hidden=2816)
    # The caching allocator hands out a whole segment when less than 1 MiB would remain:
    # up to 1 MiB per allocation (one shard per unit, a temporary or two), plus scalars.
    slack = (4 + cfg.n_layers + 1 + 2) * mib
    full_bytes = 4 * sum(p.numel() for p in LlamaModel(LlamaConfig(**{**cfg.__dict__, "n_layers": 1})).parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = _meta_sharded(cfg, {})
    shards = sum(s.unit.sharded_flat.numel() * 4 for s in iter_states(model))
    out = {"shards_mib": shards / mib}
    held = torch.cuda.memory_allocated() - base
    assert held <= shards + slack, f"fully_shard on meta allocated {held / mib:.1f} MiB, shards are {shards / mib:.1f}"
    out["fully_shard_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / mib
    assert torch.cuda.max_memory_allocated() - base <= shards + slack

    module_bytes = _module_full_bytes(model)
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(SEED)
    mfsdp.materialize(model)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out.update(materialize_peak_mib=peak / mib, largest_module_mib=module_bytes / mib)
    assert peak <= shards + module_bytes + slack, (
        f"materialize peaked at {peak / mib:.1f} MiB > shards {shards / mib:.1f} + one module "
        f"{module_bytes / mib:.1f} MiB")

    # Rank 0's full dict stays on its CPU; each tensor crosses the GPU once, whole.
    torch.manual_seed(SEED + 1)
    source_sd = {k: v for k, v in LlamaModel(cfg).state_dict().items()} if rank == 0 else None  # CPU
    largest_param = max(u.numel() * 4 for s in iter_states(model) for u in s.unsharded_params)
    again = _meta_sharded(cfg, {})
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mfsdp.load_full_state_dict(again, source_sd, broadcast_from_rank0=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    out["broadcast_load_peak_mib"] = peak / mib
    assert peak <= largest_param + slack, f"broadcast load peaked {peak / mib:.1f} MiB above the shards"
    del again

    # safetensors: each rank reads only the rows of its slices.
    directory = [tempfile.mkdtemp(prefix="mfsdp_st_") if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in source_sd.items()}, f"{directory[0]}/model.safetensors")
    dist.barrier()
    third = _meta_sharded(cfg, {})
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mfsdp.load_safetensors(third, directory[0])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    out["safetensors_load_peak_mib"] = peak / mib
    dist.barrier()  # every rank has read the file
    if rank == 0:
        shutil.rmtree(directory[0])
    biggest_piece = max(p.numel() * 4 for p in third.parameters())
    assert peak <= biggest_piece + slack, f"load_safetensors peaked {peak / mib:.1f} MiB above the shards"
    out["full_model_mib"] = (full_bytes + (cfg.n_layers - 1) * 4 * sum(
        p.numel() for p in LlamaModel(LlamaConfig(**{**cfg.__dict__, "n_layers": 1})).blocks.parameters())) / mib
    return out


def load_state_dict_into_meta_model(rank: int, world: int, opts: Dict) -> Dict:
    """torch's own loads into a model built on the meta device (model.load_state_dict of a
    full state dict, or set_model_state_dict with full_state_dict and broadcast_from_rank0,
    as for FSDP2 after to_empty): every unit the load wrote whole holds the values, so
    forward runs (it once refused, asking for materialize(), which then overwrote them).
    A partial load leaves its units deferred, and materialize() refuses to overwrite what
    was loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = device_for_backend()
    cfg = _cfg(opts)
    torch.manual_seed(SEED + 1)
    source = LlamaModel(cfg).to(device)
    sd = {k: v.detach().cpu().clone() for k, v in source.state_dict().items()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5)).to(device)
    errs = {}
    for how in ("load_state_dict", "set_model_state_dict_broadcast"):
        model = _meta_sharded(cfg, opts)
        if how == "load_state_dict":
            result = model.load_state_dict({k: v.to(device) for k, v in sd.items()})
            assert not result.missing_keys and not result.unexpected_keys, result
        else:
            set_model_state_dict(model, sd if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        check_local_shards(model, source)
        with torch.no_grad():
            errs[how] = rel_err(model(tokens), source(tokens))
        assert errs[how] <= 1e-5, f"{how}: forward after loading into a meta model: rel err {errs[how]}"
        expect_error(lambda: mfsdp.materialize(model), ValueError, "nothing to initialize")

    model = _meta_sharded(cfg, opts)
    partial = {k: v for k, v in sd.items() if k != "blocks.1.mlp.w_down.weight"}
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["blocks.1.mlp.w_down.weight"], result
    expect_error(lambda: model(tokens), RuntimeError, "Block (unit of", "materialize")
    expect_error(lambda: mfsdp.materialize(model), RuntimeError, "would overwrite the loaded values",
                 "w_down.weight")
    model.load_state_dict({"blocks.1.mlp.w_down.weight": sd["blocks.1.mlp.w_down.weight"]}, strict=False)
    check_local_shards(model, source)  # the two loads together wrote the unit
    with torch.no_grad():
        assert rel_err(model(tokens), source(tokens)) <= 1e-5
    return errs


def to_empty_then_reset_parameters(rank: int, world: int, way: str = "to_empty") -> bool:
    """FSDP2's way in from the meta device with torch's own initializers: fully_shard on
    meta, `to_empty(device=...)`, then each module's reset_parameters() (kaiming_uniform_,
    uniform_), nn.init.trunc_normal_ and normal_ on the parameters and on their `.data`, and a copy_ of a whole
    value, and the structural initializers (orthogonal_, sparse_, eye_: a whole matrix).
    Every rank's pieces are one plain process's values for the same seed (the
    random draws are whole parameters), the RNG ends where that process's does, and a
    training step matches it. way="outer": to_empty on a plain module holding the sharded
    one. way="built": the model built on the device and sharded,
    then initialized the same way (model.apply(init_fn) after fully_shard); an optimizer
    step then ends the watch, as training does."""
    from megatron_fsdp_ext.core.sharded_param import ShardedParameter

    device = device_for_backend()

    def build():
        return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5),
                             nn.Linear(5, 5))

    def init(m):
        for layer in (m[0], m[2], m[4], m[5]):
            layer.reset_parameters()
        nn.init.trunc_normal_(m[2].weight, std=0.5, a=-0.6, b=0.6)  # rejection redraws
        m[4].bias.normal_(0.0, 0.1)
        # through .data, as older Hugging Face `_init_weights` write
        m[2].bias.data.uniform_(-0.3, 0.3)
        nn.init.normal_(m[5].bias.data, std=0.2)
        m[0].bias.copy_(torch.arange(24, dtype=torch.float32, device=device))
        # the structural initializers: a whole matrix drawn or written
        nn.init.orthogonal_(m[4].weight, gain=0.8)
        nn.init.sparse_(m[0].weight, 0.5, std=0.1)
        nn.init.eye_(m[5].weight)

    with torch.device(device):
        ref = build()
    torch.manual_seed(11)
    with torch.no_grad():
        init(ref)
    ref_rng = torch.get_rng_state()
    with torch.device(device if way == "built" else "meta"):
        model = build()
    for m in (model[0], model[2], model):
        mfsdp.fully_shard(m)
    if way == "to_empty":
        assert model.to_empty(device=device) is model
    elif way == "outer":  # to_empty on a module around ours (Lightning's Trainer: the LightningModule)
        outer = nn.Module()
        outer.net = model
        assert outer.to_empty(device=device) is outer
    torch.manual_seed(11)
    with torch.no_grad():
        init(model)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the initializers drew another amount of random numbers"
    check_local_shards(model, ref)
    with torch.no_grad():
        model[2].weight.data.clone().normal_()  # a draw into a copy of .data: the parameter keeps its values
    check_local_shards(model, ref)
    if way == "built":
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # no gradients yet: changes nothing
        assert ShardedParameter.__torch_function__ is torch._C._disabled_torch_function_impl, \
            "the watch outlived the first optimizer step"
        # torch's own structural initializers again: a piece is refused, on every rank
        expect_error(lambda: nn.init.orthogonal_(model[4].weight), ValueError, "2 or more dimensions")
    x = torch.randn(world, 4, 16, generator=torch.Generator().manual_seed(3)).to(device)
    model(x[rank]).pow(2).mean().backward()
    (sum(ref(x[r]).pow(2).mean() for r in range(world)) / world).backward()
    check_grads(0, model, ref, replicated=False, tol=1e-5)
    return True


class _LoraBlock(nn.Module):
    """A base projection and a low-rank adapter beside it (torchtune's LoRALinear)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(16, 24)
        self.lora_a = nn.Linear(16, 2, bias=False)
        self.lora_b = nn.Linear(2, 24, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def to_empty_inside_a_unit_then_load_the_rest(rank: int, world: int, load: str) -> bool:
    """torchtune's first LoRA run: the model built on meta and sharded, then to_empty() on
    the adapters only (modules inside a unit) and their initializers, then a load of the
    base weights alone (strict=False). `load` "assign_dtensors": torchtune's
    load_from_full_model_state_dict (DTensors distributed as the meta state dict's, with
    assign=True); "full_values": a plain state dict of full tensors. Each emptied
    parameter counts as written, so the unit holds its values once the base load lands:
    every piece is one plain process's value for the same seeds (the adapters' draws are
    whole parameters; the RNG ends where that process's does), nothing reports is_meta,
    and a training step's gradients match. Ranks whose pieces of the adapters are empty
    (world 3) decide alike."""
    from torch.distributed.tensor import distribute_tensor

    device = device_for_backend()

    def build():
        return nn.Sequential(_LoraBlock(), nn.Tanh(), nn.Linear(24, 5))

    def init_adapters(m):
        nn.init.kaiming_uniform_(m[0].lora_a.weight, a=5 ** 0.5)
        nn.init.normal_(m[0].lora_b.weight, std=0.2)

    torch.manual_seed(0)
    with torch.device(device):
        ref = build()
    torch.manual_seed(11)
    with torch.no_grad():
        init_adapters(ref)
    ref_rng = torch.get_rng_state()
    base = {k: v.detach().clone() for k, v in ref.state_dict().items() if "lora" not in k}

    with torch.device("meta"):
        model = build()
    mfsdp.fully_shard(model[0])
    mfsdp.fully_shard(model)
    for adapter in (model[0].lora_a, model[0].lora_b):
        adapter.to_empty(device=device)
    lora = [n for n, p in model.named_parameters() if "lora" in n]
    meta = sorted(n for n, p in model.named_parameters() if p.is_meta)
    assert meta == sorted(set(n for n, _ in model.named_parameters()) - set(lora)), meta
    torch.manual_seed(11)
    with torch.no_grad():
        init_adapters(model)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the adapters' initializers drew another amount"
    if load == "assign_dtensors":
        meta_sd = model.state_dict()
        loaded = {k: nn.Parameter(distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements))
                  for k, v in base.items()}
        result = model.load_state_dict(loaded, strict=False, assign=True)
    else:
        result = model.load_state_dict(base, strict=False)
    assert sorted(result.missing_keys) == sorted(lora) and not result.unexpected_keys, result
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    check_local_shards(model, ref)
    x = torch.randn(world, 4, 16, generator=torch.Generator().manual_seed(3)).to(device)
    model(x[rank]).pow(2).mean().backward()
    (sum(ref(x[r]).pow(2).mean() for r in range(world)) / world).backward()
    check_grads(0, model, ref, replicated=False, tol=1e-5)
    return True


def apply_inside_a_unit_is_not_to_empty(rank: int, world: int) -> bool:
    """Only nn.Module.to_empty's function counts as emptying parameters inside a unit:
    other functions through nn.Module._apply keep their meaning on every rank alike. A
    whole value (`torch.full(t.shape, ...)`: the parameter's shape) is each rank's slice
    of it, on the rank holding a 1-D bias whole as on one holding none of it; new tensors
    of the piece's shape (clone, zeros_like) replace the pieces and leave a unit built on
    meta waiting for its values. The same holds on the units' own modules and on a
    module around them."""
    from megatron_fsdp_ext.core.param_index import owner_of

    for meta in (False, True):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 2))
        mfsdp.fully_shard(model[0])
        mfsdp.fully_shard(model)
        first = model[0][0]
        first._apply(lambda t: torch.full(t.shape, 0.5))
        first._apply(torch.clone)
        state, _ = owner_of(first.bias)
        assert not state.loaded_while_deferred, f"meta={meta}: counted as loaded {state.loaded_while_deferred}"
        assert all(p.is_meta == meta for p in first.parameters()), meta
        if not meta:
            values = mfsdp.full_state_dict(model, rank0_only=False)
            assert all((values[k] == 0.5).all() for k in ("0.0.weight", "0.0.bias")), values["0.0.bias"]
            model[0][1]._apply(torch.zeros_like)
            values = mfsdp.full_state_dict(model, rank0_only=False)
            assert all((values[k] == 0).all() for k in ("0.1.weight", "0.1.bias")), values["0.1.bias"]
            # On the units' own modules and around them, as on a plain module: only
            # to_empty's function keeps the shards as they are.
            model._apply(lambda t: torch.full_like(t, 0.25))
            values = mfsdp.full_state_dict(model, rank0_only=False)
            assert all((v == 0.25).all() for v in values.values()), values
            nn.Sequential(model)._apply(torch.zeros_like)
            values = mfsdp.full_state_dict(model, rank0_only=False)
            assert all((v == 0).all() for v in values.values()), values
        else:
            mfsdp.materialize(model)  # no load or to_empty wrote any of it: materialize runs
    return True
