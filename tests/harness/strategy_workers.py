"""Distributed test bodies for sharding strategies and DCP checkpoints (run under
harness.run_distributed, on Gloo or NCCL)."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.dcp import load_checkpoint, save_checkpoint
from megatron_fsdp_ext.core.param_index import iter_states
from megatron_fsdp_ext.core.states import SlotsHold

from .workers import (build_models, check_grads, device_for_backend, expect_error, global_batches, rel_err, shard,
                      step_with_reference)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def _train(model, opt, cfg, batches, rank, world, per):
    """One step per global batch on this rank's rows; returns the global mean losses."""
    losses = []
    for tokens, targets in batches:
        rows = slice(rank * per, (rank + 1) * per)
        loss = model.loss(tokens[rows], targets[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _reference(cfg, ref, batches):
    opt = _adamw(ref.parameters())
    for tokens, targets in batches:
        ref.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def strategy_api(rank: int, world: int, strategy: str) -> Dict:
    """unshard/reshard, memory held between steps and the full state dict under one strategy."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 2}, device)
    shard(model, {"strategy": strategy})
    states = [model._fsdp_state] + [b._fsdp_state for b in model.blocks]
    opt = _adamw(model.parameters())
    per = 2
    batches = list(global_batches(cfg, 2, per * world, 8, device))
    _train(model, opt, cfg, batches[:1], rank, world, per)
    # The collectives of one steady step say what the strategy shards (Megatron-FSDP's
    # definitions): no_shard never gathers; no_shard and optim (ZeRO-1) all-reduce full
    # gradients; optim_grads and optim_grads_params reduce-scatter them.
    before = dict(_C.collective_counts())
    _train(model, opt, cfg, batches[1:], rank, world, per)
    calls = {k: v[0] - before[k][0] for k, v in _C.collective_counts().items()}
    nbytes = {k: v[1] - before[k][1] for k, v in _C.collective_counts().items()}
    gathers, full_grads = strategy != "no_shard", strategy in ("no_shard", "optim")
    assert (calls["all_gather"] > 0) == gathers, (strategy, calls)
    # Every strategy also all-reduces a few bytes a unit: which parameters got gradients.
    grad_all_reduce = nbytes["all_reduce"] > 4096
    assert grad_all_reduce == full_grads and (calls["reduce_scatter"] > 0) != full_grads, (strategy, calls, nbytes)
    held = [s.unit.unsharded_storage_bytes for s in states]
    if strategy == "optim_grads_params":
        assert held == [0] * len(held), f"ZeRO-3 keeps unsharded params between steps: {held}"
    elif strategy == "no_shard":
        assert held == [0] * len(held), f"no_shard (no cast) needs no copy of the params: {held}"
    else:
        assert all(h > 0 for h in held), f"{strategy} must keep the unsharded params between steps: {held}"
    # The module always shows the shards between steps; the optimizer updates those.
    for s in states:
        assert s.slots_hold is SlotsHold.SHARDED
        for p, u in zip(s.sharded_params, s.unsharded_params):
            if strategy == "no_shard":
                assert p.detach().numel() == u.numel(), "no_shard: every rank holds the whole parameter"
    # unshard() installs full parameters; reshard() gives the shards back.
    model.blocks[0].unshard()
    w = model.blocks[0].attn.wqkv.weight
    assert tuple(w.shape) == (3 * cfg.d_model, cfg.d_model), tuple(w.shape)
    model.blocks[0].reshard()
    assert model.blocks[0].attn.wqkv.weight.detach().dim() == 1
    sd = mfsdp.full_state_dict(model, rank0_only=False)
    assert set(sd) == set(ref.state_dict())
    # Bad input.
    expect_error(lambda: mfsdp.fully_shard(torch.nn.Linear(2, 2).to(device), sharding_strategy="zero3"),
                 ValueError, "unknown sharding_strategy 'zero3'", "optim_grads_params")
    if strategy != "optim_grads_params":
        expect_error(lambda: mfsdp.fully_shard(torch.nn.Linear(2, 2).to(device), sharding_strategy=strategy,
                                               reshard_after_forward=True),
                     ValueError, "reshard_after_forward=True", strategy)
        expect_error(lambda: model.set_reshard_after_forward(True), ValueError, strategy)
    return {"held": held}


def checkpoint_save(rank: int, world: int, strategy: str, path: str, steps: int = 3) -> None:
    """Train `steps` steps under `strategy`, then save model and optimizer with DCP."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 2}, device)
    shard(model, {"strategy": strategy})
    opt = _adamw(model.parameters())
    per = 2
    _train(model, opt, cfg, list(global_batches(cfg, steps, per * world, 8, device)), rank, world, per)
    save_checkpoint(path, model, opt)


def checkpoint_resume(rank: int, world: int, strategy: str, path: str, saved_steps: int = 3, more: int = 2,
                      saved_world: int = 2) -> Dict:
    """Load a checkpoint written under another world size / strategy, check the optimizer
    state against the single-process reference, train on, and match the reference."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 2}, device)
    torch.manual_seed(99)  # the load must overwrite a different initialisation
    for p in model.parameters():
        torch.nn.init.normal_(p)
    shard(model, {"strategy": strategy})
    opt = _adamw(model.parameters())
    per_saved = 2
    all_batches = list(global_batches(cfg, saved_steps + more, per_saved * saved_world, 8, device))
    ref_opt = _reference(cfg, ref, all_batches[:saved_steps])
    load_checkpoint(path, model, opt)

    # Parameters and Adam moments equal the reference's (slices of the flattened tensors).
    full = mfsdp.full_state_dict(model, rank0_only=False)
    worst_param = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    ref_params = dict(ref.named_parameters())
    worst_state = 0.0
    for name, p in model.named_parameters():
        st = opt.state[p]
        assert int(st["step"]) == saved_steps, f"step {st['step']} for {name}"
        rp = ref_params[name]
        for key in ("exp_avg", "exp_avg_sq"):
            ref_flat = ref_opt.state[rp][key].reshape(-1)
            owner = p._mfsdp_owner()
            idx = next(i for i, q in enumerate(owner.sharded_params) if q is p)
            piece = owner.unit.layout.shard_slices(owner.unit.shard_index)[idx]
            expected = ref_flat[piece.param_offset: piece.param_offset + piece.numel]
            if expected.numel():
                worst_state = max(worst_state, rel_err(st[key], expected))
    assert worst_param <= 1e-5, f"loaded parameters differ from the reference: {worst_param}"
    assert worst_state <= 1e-4, f"loaded optimizer state differs from the reference: {worst_state}"

    # Train on: the global batches continue where the saving run stopped.
    per = per_saved * saved_world // world
    _train(model, opt, cfg, all_batches[saved_steps:], rank, world, per)
    for tokens, targets in all_batches[saved_steps:]:
        ref.loss(tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    full = mfsdp.full_state_dict(model, rank0_only=False)
    worst_after = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert worst_after <= 1e-5, f"resumed training differs from the reference: {worst_after}"
    return {"param": worst_param, "state": worst_state, "after": worst_after}


def checkpoint_bitwise_resume(rank: int, world: int, strategy: str, path: str) -> None:
    """Save at step 3 of 5; a fresh model that loads it and trains 2 steps ends bitwise
    equal (fp32) to the run that never stopped, losses included."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 2}, device)
    shard(model, {"strategy": strategy})
    opt = _adamw(model.parameters())
    per = 2
    batches = list(global_batches(cfg, 5, per * world, 8, device))
    _train(model, opt, cfg, batches[:3], rank, world, per)
    save_checkpoint(path, model, opt)
    losses = _train(model, opt, cfg, batches[3:], rank, world, per)

    cfg2, fresh, _ = build_models({"layers": 2}, device)
    shard(fresh, {"strategy": strategy})
    fresh_opt = _adamw(fresh.parameters())
    load_checkpoint(path, fresh, fresh_opt)
    fresh_losses = _train(fresh, fresh_opt, cfg2, batches[3:], rank, world, per)
    assert fresh_losses == losses, f"losses after resume {fresh_losses} vs uninterrupted {losses}"
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), f"'{n}' differs after resume"
    for a, b in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], fresh_opt.state[b][key])


def checkpoint_bad_input(rank: int, world: int, path: str) -> None:
    """Missing/extra keys and mismatched shapes are errors that name the key."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 2}, device)
    shard(model, {})
    opt = _adamw(model.parameters())
    _train(model, opt, cfg, list(global_batches(cfg, 1, 2 * world, 8, device)), rank, world, 2)
    save_checkpoint(path, model, opt)

    _, deeper, _ = build_models({"layers": 3}, device)  # has blocks.2.*: missing from the file
    shard(deeper, {})
    expect_error(lambda: load_checkpoint(path, deeper), KeyError, "missing from the checkpoint", "blocks.2.")
    _, shallower, _ = build_models({"layers": 1}, device)  # lacks blocks.1.*: extra in the file
    shard(shallower, {})
    expect_error(lambda: load_checkpoint(path, shallower), KeyError, "not in the model", "blocks.1.")
    _, wider, _ = build_models({"layers": 2, "ffn": 96}, device)
    shard(wider, {})
    expect_error(lambda: load_checkpoint(path, wider), ValueError, "model.blocks.0.mlp.w_gate_up.weight",
                 "(176, 32)", "(192, 32)")
    # An optimizer over other parameters, or no optimizer state in the file.
    _, same, _ = build_models({"layers": 2}, device)
    shard(same, {})
    save_checkpoint(path + "_model_only", same)
    expect_error(lambda: load_checkpoint(path + "_model_only", same, _adamw(same.parameters())),
                 KeyError, "optimizer.param_groups")
    partial = torch.optim.AdamW(list(same.parameters())[:3], lr=1e-4)
    expect_error(lambda: load_checkpoint(path, same, partial), KeyError, "'blocks.0.attn.wo.weight'",
                 "not in this optimizer")


def megatron_config_parity(rank: int, world: int, config_kwargs: Dict, unit_modules: bool = True) -> Dict:
    """fully_shard_model + FSDPConfig (+ attach_param_sync) trains like the reference:
    every parameter's full gradient at every step (AdamW's update barely changes when
    all gradients are scaled), and the parameters at the end."""
    from megatron_fsdp_ext.models import Block

    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 3}, device)
    config = mfsdp.FSDPConfig(**config_kwargs)
    mfsdp.fully_shard_model(model, config, fsdp_unit_modules=[Block] if unit_modules else None)
    states = list(iter_states(model))
    opt = _adamw(model.parameters())
    mfsdp.attach_param_sync(opt, model)
    ref_opt = _adamw(ref.parameters())
    replicated = config.data_parallel_sharding_strategy == "no_shard"
    per = 2
    for step, (tokens, targets) in enumerate(global_batches(cfg, 4, per * world, 8, device)):
        model.loss(tokens[rank * per: (rank + 1) * per], targets[rank * per: (rank + 1) * per]).backward()
        ref.loss(tokens, targets).backward()
        check_grads(step, model, ref, replicated, tol=1e-5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    full = mfsdp.full_state_dict(model, rank0_only=False)
    worst = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert worst <= 1e-5, f"{config}: parameters differ from the reference by {worst}"
    return {"units": len(states), "worst": worst}


def megatron_config_errors(rank: int, world: int) -> None:
    from megatron_fsdp_ext.models import Block

    device = device_for_backend()
    expect_error(lambda: mfsdp.FSDPConfig(data_parallel_sharding_strategy="zero2"), ValueError,
                 "unknown sharding_strategy 'zero2'")
    expect_error(lambda: mfsdp.FSDPConfig(bf16=True, fp16=True), ValueError, "bf16 and fp16")
    expect_error(lambda: mfsdp.FSDPConfig(bucket_size=0), ValueError, "bucket_size")
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(device)
    expect_error(lambda: mfsdp.fully_shard_model(lin, mfsdp.FSDPConfig(), fsdp_unit_modules=[Block]),
                 ValueError, "fsdp_unit_modules", "Block")
    expect_error(lambda: mfsdp.fully_shard_model(lin, {"bf16": True}), TypeError, "FSDPConfig")


def strategy_peak_memory(rank: int, world: int, strategy: str) -> Dict:
    """Peak GPU memory of one training step (fp32 params, fused AdamW) under a strategy,
    on a model whose parameters dwarf its activations, so the strategies' gaps show.
    Per-unit collectives: "auto" buckets size themselves from the measured link (up to
    256 MiB at world 4 on H200s), and a reduce bucket that holds several blocks' unsharded
    gradients hides the gap between optim and optim_grads this test is about."""
    from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

    device = device_for_backend()
    cfg = LlamaConfig(vocab_size=4096, d_model=1024, n_layers=8, n_heads=16, ffn_hidden=2816)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    per_unit = dict(gather_bucket_bytes=0, reduce_bucket_bytes=0)
    for b in model.blocks:
        mfsdp.fully_shard(b, sharding_strategy=strategy, **per_unit)
    mfsdp.fully_shard(model, sharding_strategy=strategy, **per_unit)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = list(global_batches(cfg, 3, 2 * world, 128, device))
    per = 2
    _train(model, opt, cfg, batches[:2], rank, world, per)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _train(model, opt, cfg, batches[2:], rank, world, per)
    torch.cuda.synchronize()
    n_params = sum(p.numel() for p in LlamaModel(cfg).parameters())
    return {"peak": torch.cuda.max_memory_allocated(), "param_bytes": 4 * n_params}


class _ExtraState(torch.nn.Module):
    """A module with extra state: a dict holding a counter and a tensor."""

    def __init__(self, seed: int):
        super().__init__()
        self.step, self.scale = seed, torch.tensor([float(seed)])

    def get_extra_state(self):
        return {"step": self.step, "scale": self.scale}

    def set_extra_state(self, state):
        self.step, self.scale = state["step"], state["scale"]


def checkpoint_odd_params(rank: int, world: int, path: str, strategy: str) -> None:
    """Parameters smaller than the world, of zero size and of odd sizes save and load;
    a parameter of the same numel but another shape is refused on load."""
    from .workers import TinyOddModel

    device = device_for_backend()

    def build(seed):
        torch.manual_seed(seed)
        m = TinyOddModel().to(device)
        m.meta = _ExtraState(seed)  # non-parameter state (as Transformer Engine keeps FP8 metadata)
        mfsdp.fully_shard(m.inner, sharding_strategy=strategy)
        mfsdp.fully_shard(m, sharding_strategy=strategy)
        return m

    model = build(0)
    opt = _adamw(model.parameters())
    x = torch.randn(4, 5, device=device)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    save_checkpoint(path, model, opt)
    fresh = build(1)
    fresh_opt = _adamw(fresh.parameters())
    load_checkpoint(path, fresh, fresh_opt)
    a, b = mfsdp.full_state_dict(model, rank0_only=False), mfsdp.full_state_dict(fresh, rank0_only=False)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"'{k}' differs after the round trip"
    assert fresh.meta.step == 0 and fresh.meta.scale.item() == 0.0, "extra state was not restored"

    torch.manual_seed(2)
    other = TinyOddModel().to(device)
    other.odd.weight = torch.nn.Parameter(torch.zeros(3, 1, device=device))  # saved: [1, 3]
    other.meta = _ExtraState(2)
    mfsdp.fully_shard(other.inner, sharding_strategy=strategy)
    mfsdp.fully_shard(other, sharding_strategy=strategy)
    expect_error(lambda: load_checkpoint(path, other), ValueError, "model.odd.weight", "(1, 3)", "(3, 1)")


def _checkpoint_every_block(model) -> None:
    """Activation checkpointing around each (fully_shard) block call: its forward
    hooks, prefetch included, run again during backward."""
    import torch.utils.checkpoint as cp

    def forward(tokens):
        x = model.embed(tokens)
        for block in model.blocks:
            x = cp.checkpoint(block, x, use_reentrant=False)
        return model.head(model.norm(x))

    model.forward = forward


def _step_then_forward_sees_it(model, opt, ref, ref_opt, tokens, targets, rows, what: str) -> None:
    """One step beside the reference; the next forward must see the new values (losses
    compared on the same batch): a kept copy that was not marked stale fails here."""
    step_with_reference(model, opt, ref, ref_opt, tokens, targets, rows)
    with torch.no_grad():
        got = model.loss(tokens[rows], targets[rows]).item()
        want = ref.loss(tokens[rows], targets[rows]).item()
    assert abs(got - want) <= 1e-4 * abs(want), f"{what}: forward used stale parameters ({got} vs {want})"


def kept_copies_follow_added_param_groups(rank: int, world: int, strategy: str) -> None:
    """An optimizer that first holds one block's parameters and later gets the rest
    (add_param_group) marks the new units' kept copies stale after its steps as well:
    the units it updates are looked up again when its parameters change."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 3}, device)
    shard(model, {"strategy": strategy})
    first, ref_first = list(model.blocks[0].parameters()), list(ref.blocks[0].parameters())
    in_first = set(map(id, first)) | set(map(id, ref_first))
    opt = torch.optim.AdamW(first, lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref_first, lr=1e-2, fused=True)
    per = 2
    for i, (tokens, targets) in enumerate(global_batches(cfg, 3, per * world, 8, device)):
        if i == 1:
            opt.add_param_group({"params": [q for q in model.parameters() if id(q) not in in_first]})
            ref_opt.add_param_group({"params": [q for q in ref.parameters() if id(q) not in in_first]})
        rows = slice(rank * per, (rank + 1) * per)
        _step_then_forward_sees_it(model, opt, ref, ref_opt, tokens, targets, rows, f"{strategy} step {i}")


def kept_copies_follow_every_write(rank: int, world: int, strategy: str, recompute: bool = False) -> None:
    """A kept unsharded copy (optim, optim_grads; no_shard's alias) never serves stale
    values: after a fused optimizer step (which does not move version counters), also
    when activation checkpointing re-gathers units during backward (before the step),
    and after `p.data = x` on a sharded parameter."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 3}, device)
    shard(model, {"strategy": strategy})
    if recompute:
        _checkpoint_every_block(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    per = 2
    for tokens, targets in global_batches(cfg, 3, per * world, 8, device):
        rows = slice(rank * per, (rank + 1) * per)
        _step_then_forward_sees_it(model, opt, ref, ref_opt, tokens, targets, rows, strategy)
    block = model.blocks[0]
    w = block.attn.wo.weight
    w.data = torch.zeros_like(w)  # breaks the view; the unit re-links it at the next use
    block.unshard()
    full = block.attn.wo.weight
    assert full.dim() == 2 and not full.detach().any(), f"{strategy}: unshard() after `p.data = 0` kept old values"
    block.reshard()
