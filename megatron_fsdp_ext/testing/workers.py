"""Distributed test workers: each trains a sharded model and a single-process
reference (same seed, same global batch) side by side and compares them.

Workers run under run_distributed on Gloo (CPU) and NCCL (GPU) alike.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel


def device_for_backend() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are empty or zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    diff = (a - b).norm().item()
    denom = b.norm().item()
    return diff / denom if denom > 0 else diff


def build_models(opts: Dict, device: torch.device):
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=opts.get("vocab", 128), d_model=opts.get("d_model", 32), n_layers=opts.get("layers", 3),
        n_heads=4, ffn_hidden=opts.get("ffn", 88), tie_embeddings=opts.get("tie", False),
    )
    model = LlamaModel(cfg)
    if opts.get("unused"):
        # Registered in a block but never called: its grads must stay None.
        model.blocks[0].unused = nn.Linear(cfg.d_model, 7)
    if opts.get("frozen"):
        model.blocks[1].attn.wqkv.weight.requires_grad_(False)
        model.norm.weight.requires_grad_(False)
    model = model.to(device)
    ref = copy.deepcopy(model)
    return cfg, model, ref


def shard(model: LlamaModel, opts: Dict) -> LlamaModel:
    mp = mfsdp.MixedPrecisionPolicy(
        param_dtype=opts.get("param_dtype"), reduce_dtype=opts.get("reduce_dtype")
    )
    raf = opts.get("reshard_after_forward", True)
    for block in model.blocks:
        mfsdp.fully_shard(block, mp_policy=mp, reshard_after_forward=raf)
    mfsdp.fully_shard(model, mp_policy=mp, reshard_after_forward=raf)
    return model


def make_optimizer(params, opts: Dict):
    kind = opts.get("optimizer", "adamw")
    if kind == "adamw":
        fused = opts.get("fused", False)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused or None)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    raise ValueError(kind)


def global_batches(cfg, steps: int, batch: int, seq: int, device):
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        yield data[:, :-1].to(device), data[:, 1:].to(device)


def train_parity(rank: int, world: int, opts: Dict) -> Dict:
    """Train sharded vs reference for opts['steps'] steps; assert parity; return stats."""
    device = device_for_backend()
    cfg, model, ref = build_models(opts, device)
    shard(model, opts)
    opt = make_optimizer(model.parameters(), opts)
    ref_opt = make_optimizer(ref.parameters(), opts)
    micro = opts.get("micro_batches", 1)
    batch = opts.get("batch", 4) * world
    seq = opts.get("seq", 16)
    clip = opts.get("clip")
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for tokens, targets in global_batches(cfg, opts.get("steps", 5), batch * micro, seq, device):
        # Reference: full global batch, split into the same micro-batches.
        ref_opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micro):
            rows = slice(m * batch, (m + 1) * batch)
            loss = ref.loss(tokens[rows], targets[rows]) / micro
            loss.backward()
            total += loss.item()
        ref_losses.append(total)
        if clip:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ref_opt.step()

        # Sharded: this rank's rows of every micro-batch; sync only on the last.
        opt.zero_grad(set_to_none=True)
        per_rank = batch // world
        total = 0.0
        for m in range(micro):
            start = m * batch + rank * per_rank
            rows = slice(start, start + per_rank)
            model.set_requires_gradient_sync(m == micro - 1)
            loss = model.loss(tokens[rows], targets[rows]) / micro
            loss.backward()
            total += loss.item()
        t = torch.tensor([total], device=device, dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        if clip:
            norms.append(mfsdp.clip_grad_norm_(model, clip).item())
        opt.step()

    # Gradients: unused params have None on both sides; others exist on both.
    ref_grad_none = {n for n, p in ref.named_parameters() if p.grad is None}
    grad_none = {n for n, p in model.named_parameters() if p.grad is None}
    assert ref_grad_none == grad_none, f"grad None mismatch: ref {sorted(ref_grad_none)} vs fsdp {sorted(grad_none)}"

    full = mfsdp.full_state_dict(model, rank0_only=False)
    ref_sd = ref.state_dict()
    assert set(full) == set(ref_sd), f"state dict keys differ: {set(full) ^ set(ref_sd)}"
    errs = {k: rel_err(full[k], ref_sd[k]) for k in ref_sd}
    worst = max(errs, key=errs.get)
    param_tol = opts.get("param_tol", 1e-5)
    loss_tol = opts.get("loss_tol", 1e-5)
    loss_errs = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(loss_errs) <= loss_tol, f"losses {losses} vs reference {ref_losses} (rel err {max(loss_errs):.2e} > {loss_tol})"
    assert errs[worst] <= param_tol, f"parameter '{worst}' rel err {errs[worst]:.3e} > {param_tol}"
    if clip:
        norm_errs = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
        assert max(norm_errs) <= opts.get("norm_tol", 1e-4), f"grad norms {norms} vs {ref_norms}"
    if opts.get("tie"):
        assert full["head.weight"].equal(full["embed.weight"]), "tied weights diverged"
    # A fresh plain module loads the full state dict.
    plain = LlamaModel(cfg)
    if opts.get("unused"):
        plain.blocks[0].unused = nn.Linear(cfg.d_model, 7)
    plain.load_state_dict(full)
    return {"losses": losses, "ref_losses": ref_losses, "max_param_err": errs[worst], "worst": worst}
