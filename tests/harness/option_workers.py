"""Distributed test bodies for the public options and methods of fully_shard,
FSDPModule, clip_grad_norm_, the full state dict and FSDPConfig: each checks the
option's effect against an independent reference (plain PyTorch on one process, a
layout computed here, or the dtypes the documentation names), not only that it runs.

Workers run under run_distributed on Gloo (CPU) and NCCL (GPU) alike.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states
from megatron_fsdp_ext.core.states import SlotsHold
from megatron_fsdp_ext.models import Block, LlamaModel

from .observe import UnitTrace
from .workers import (build_models, device_for_backend, expect_error, global_batches, rel_err, shard_blocks_and_root,
                      shard_piece, step_with_reference)


# ---------------------------------------------------------------- helpers

def expected_shard(full: torch.Tensor, sharded_param: torch.Tensor) -> torch.Tensor:
    """The part of a full (reference) tensor that `sharded_param`, a 1-D shard, holds."""
    _, _, piece = shard_piece(sharded_param)
    return full.detach().reshape(-1)[piece.param_offset: piece.param_offset + piece.numel]


def worst_grad_error(model: nn.Module, ref: nn.Module) -> float:
    """Largest relative error of the sharded gradients against the reference's."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        expected = expected_shard(ref_params[name].grad, p)
        assert p.grad is not None, f"'{name}' got no gradient"
        if expected.numel():
            worst = max(worst, rel_err(p.grad, expected))
    return worst


def worst_param_error(model: nn.Module, ref: nn.Module) -> float:
    full = mfsdp.full_state_dict(model, rank0_only=False)
    return max(rel_err(full[k], v) for k, v in ref.state_dict().items())


def rows_of(rank: int, per_rank: int) -> slice:
    return slice(rank * per_rank, (rank + 1) * per_rank)


def expected_even_layout(numels: List[int], world: int, alignment: int):
    """FlatLayout.even computed independently: every parameter starts on a multiple of
    `alignment`; the padded total splits into `world` equal segments that are whole
    numbers of alignment units."""
    offsets, cursor = [], 0
    for n in numels:
        cursor = -(-cursor // alignment) * alignment
        offsets.append(cursor)
        cursor += n
    segment = -(-(-(-cursor // world)) // alignment) * alignment
    return offsets, segment


class _DtypeProbe(nn.Module):
    """Records the dtype of the input its forward receives; computes in the weight's dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: List[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


class _TwoOutputs(nn.Module):
    """Returns a floating tensor and an integer one (output_dtype casts only the first)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return y, y.argmax(-1)


# ---------------------------------------------------------------- precision and layout

def precision_and_layout_options(rank: int, world: int) -> Dict:
    """alignment (1, 64), output_dtype, cast_forward_inputs=False, FSDPConfig's
    bf16 / fp16 / grad_reduce_in_fp32, and a model whose parameters are fp16."""
    device = device_for_backend()
    report = {}
    per = 2

    # alignment: offsets and segments follow it exactly (1 means no padding between
    # parameters), and training matches the reference.
    for alignment in (1, 64):
        # d_model 40: the norm weights' 40 elements leave every default (16) alignment gap.
        cfg, model, ref = build_models({"layers": 2, "d_model": 40}, device)
        shard_blocks_and_root(model, alignment=alignment)
        for state in iter_states(model):
            layout = state.unit.layout
            numels = list(layout.numels)
            offsets, segment = expected_even_layout(numels, world, alignment)
            assert layout.alignment == alignment, f"{state}: layout alignment {layout.alignment} != {alignment}"
            assert list(layout.offsets) == offsets, (
                f"{state} alignment {alignment}: offsets {list(layout.offsets)} != {offsets}")
            assert list(layout.segment_numels) == [segment] * world, (
                f"{state} alignment {alignment}: segments {list(layout.segment_numels)}, expected {segment} each")
            assert state.unit.sharded_flat.numel() == segment
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for tokens, targets in global_batches(cfg, 3, per * world, 8, device):
            step_with_reference(model, opt, ref, ref_opt, tokens, targets, rows_of(rank, per))
        report[f"alignment_{alignment}"] = worst_param_error(model, ref)
        assert report[f"alignment_{alignment}"] <= 1e-5, f"alignment {alignment}: parity error {report}"

    # output_dtype: floating outputs come out in it (integer ones untouched), values and
    # gradients are those of the plain module's output cast to it.
    torch.manual_seed(0)
    x = torch.randn(6, 4, device=device)
    for param_dtype, output_dtype in ((None, torch.float64), (torch.bfloat16, torch.float32)):
        torch.manual_seed(1)
        module = _TwoOutputs().to(device)
        ref = copy.deepcopy(module)
        if param_dtype is not None:
            ref.to(param_dtype)
        policy = mfsdp.MixedPrecisionPolicy(param_dtype=param_dtype, output_dtype=output_dtype)
        mfsdp.fully_shard(module, mp_policy=policy)
        y, idx = module(x)
        y_ref, idx_ref = ref(x.to(param_dtype or x.dtype))
        assert y.dtype == output_dtype, f"output_dtype={output_dtype}: output came out in {y.dtype}"
        assert idx.dtype == torch.int64, f"output_dtype cast an integer output to {idx.dtype}"
        assert torch.equal(y, y_ref.to(output_dtype)), f"output_dtype={output_dtype}: values differ"
        (y * y).sum().backward()
        (y_ref.to(output_dtype) ** 2).sum().backward()
        # The sharded gradients are fp32 master gradients; the reference's are in its
        # compute dtype, so compare at that dtype's precision.
        tol = 1e-6 if param_dtype is None else 1e-2
        assert worst_grad_error(module, ref) <= tol, f"output_dtype={output_dtype}: gradients differ"

    # cast_forward_inputs: on (default), the module's forward sees param_dtype inputs;
    # off, it sees the caller's dtype.
    for cast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        probe = _DtypeProbe().to(device)
        policy = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
        mfsdp.fully_shard(probe, mp_policy=policy)
        probe(x)
        assert probe.seen == [expected], f"cast_forward_inputs={cast}: forward saw {probe.seen}"

    # FSDPConfig: the unit dtypes its fields stand for; shards stay in the model's dtype.
    cases = [
        ({}, torch.float32, torch.float32, torch.float32),
        ({"bf16": True}, torch.float32, torch.bfloat16, torch.bfloat16),
        ({"fp16": True}, torch.float32, torch.float16, torch.float16),
        ({"bf16": True, "grad_reduce_in_fp32": True}, torch.float32, torch.bfloat16, torch.float32),
        ({"fp16": True, "grad_reduce_in_fp32": True}, torch.float32, torch.float16, torch.float32),
        ({"grad_reduce_in_fp32": True}, torch.bfloat16, torch.bfloat16, torch.float32),
    ]
    for fields, model_dtype, param_dtype, reduce_dtype in cases:
        cfg, model, _ = build_models({"layers": 1}, device)
        model.to(model_dtype)
        mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(**fields), fsdp_unit_modules=[Block])
        seen = []
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(m.attn.wqkv.weight.dtype))
        tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
        model.loss(tokens, tokens).backward()
        for state in iter_states(model):
            unit = state.unit
            got = (unit.orig_dtype, unit.param_dtype, unit.reduce_dtype)
            assert got == (model_dtype, param_dtype, reduce_dtype), (
                f"FSDPConfig({fields}): unit dtypes (orig, param, reduce) {got}, "
                f"expected {(model_dtype, param_dtype, reduce_dtype)}")
        assert seen == [param_dtype], f"FSDPConfig({fields}): block computed with {seen}"
        assert all(p.dtype == model_dtype and p.grad.dtype == model_dtype for p in model.parameters())

    report["fp16"] = _fp16_parameters_parity(rank, world, device)
    return report


def _fp16_parameters_parity(rank: int, world: int, device) -> Dict:
    """A model whose parameters are fp16 (no policy: gathered, computed and reduced in
    fp16) trains like the same fp16 model on one process."""
    cfg, model, ref = build_models({"layers": 2}, device)
    model.half()
    ref.half()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    shard_blocks_and_root(model)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    per = 2
    loss_errs = []
    for tokens, targets in global_batches(cfg, 4, per * world, 8, device):
        loss = model.loss(tokens[rows_of(rank, per)], targets[rows_of(rank, per)])
        loss.backward()
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_loss = ref.loss(tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().double().reshape(1)
        dist.all_reduce(mean)
        loss_errs.append(abs(mean.item() / world - ref_loss.item()) / ref_loss.item())
    full = mfsdp.full_state_dict(model, rank0_only=False)
    ref_sd = ref.state_dict()
    # Each step the sharded gradient is rounded to fp16 a few more times than the
    # reference's (per-rank partial sums, the fp16 reduce-scatter, the 1/world scale):
    # a few units of fp16's 2^-11 relative rounding per step. Measured after 4 steps:
    # at most 0.6% of a parameter's update, losses within 4e-6; the bounds leave 3x and 8x.
    # Norm weights whose updates round away in fp16 (1 + u == 1) must not move at all.
    errs = {k: rel_err(full[k], ref_sd[k]) for k in ref_sd}
    moved = {k: rel_err(ref_sd[k], init[k]) for k in ref_sd}
    frac = {k: errs[k] / moved[k] for k in ref_sd if moved[k] > 0}
    worst = max(frac, key=frac.get)
    assert frac[worst] <= 0.02, f"fp16: '{worst}' error is {frac[worst]:.3f} of its update"
    still = [k for k in ref_sd if moved[k] == 0 and errs[k] > 0]
    assert not still, f"fp16: {still} moved although the reference's did not"
    assert max(loss_errs) <= 3e-5, f"fp16: losses differ by {loss_errs}"
    return {"worst_frac_of_update": frac[worst], "loss_errs": loss_errs}


# ---------------------------------------------------------------- ignored params, clip, state dicts

def ignored_params_clip_and_state_dicts(rank: int, world: int) -> Dict:
    """ignored_params; clip_grad_norm_ with norm types 1 / inf / 3, an iterable and
    error_if_nonfinite; full_state_dict(cpu_offload=False); load_full_state_dict(strict=False)."""
    device = device_for_backend()
    per = 2
    report = {}

    # ignored_params (as in PyTorch FSDP2): not sharded, left as the module's own full
    # parameters, and their gradients are not reduced: each rank keeps its local gradient.
    cfg, model, ref_global = build_models({"layers": 2}, device)
    ref_local = copy.deepcopy(ref_global)
    ignored = {"blocks.0.attn.wo.weight": model.blocks[0].attn.wo.weight, "head.weight": model.head.weight}
    shard_blocks_and_root(model, ignored_params=ignored.values())
    params = dict(model.named_parameters())
    for name, p in ignored.items():
        assert params[name] is p, f"ignored '{name}' was replaced"
        assert p.shape == ref_global.get_parameter(name).shape, f"ignored '{name}' lost its full shape"
        assert getattr(p, "_mfsdp_owner", None) is None, f"ignored '{name}' belongs to a unit"
    sharded_numel = torch.tensor([sum(p.detach().numel() for n, p in params.items() if n not in ignored)], device=device)
    dist.all_reduce(sharded_numel)
    expected_numel = sum(p.numel() for n, p in ref_global.named_parameters() if n not in ignored)
    assert sharded_numel.item() == expected_numel, "the other parameters must be sharded exactly once"
    tokens, targets = next(global_batches(cfg, 1, per * world, 8, device))
    rows = rows_of(rank, per)
    model.loss(tokens[rows], targets[rows]).backward()
    ref_global.loss(tokens, targets).backward()
    ref_local.loss(tokens[rows], targets[rows]).backward()
    for name, p in ignored.items():
        local = ref_local.get_parameter(name).grad
        assert rel_err(p.grad, local) <= 1e-5, f"ignored '{name}': gradient is not this rank's local one"
        norms = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(norms, p.grad.norm().reshape(1))
        assert len({n.item() for n in norms}) == world, f"ignored '{name}': ranks hold the same (reduced) gradient"
    ref_params = dict(ref_global.named_parameters())
    for name, p in params.items():
        if name not in ignored:
            expected = expected_shard(ref_params[name].grad, p)
            assert rel_err(p.grad, expected) <= 1e-5, f"'{name}': sharded gradient differs from the reference"
    # The state dicts carry ignored parameters as they are, and load them back.
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for name, p in ignored.items():
        assert torch.equal(full[name].to(device), p.detach()), f"full_state_dict lost ignored '{name}'"
    torch.manual_seed(5)
    other = LlamaModel(cfg).to(device)
    mfsdp.load_full_state_dict(model, other.state_dict())
    for name, p in ignored.items():
        assert torch.equal(p.detach(), other.get_parameter(name).detach()), f"load_full_state_dict skipped '{name}'"

    report["clip"] = _clip_options(rank, world, device)
    report["state_dicts"] = _state_dict_options(rank, world, device)
    return report


def _clip_options(rank: int, world: int, device) -> Dict:
    cfg, model, ref = build_models({"layers": 2}, device)
    shard_blocks_and_root(model)
    per = 2
    tokens, targets = next(global_batches(cfg, 1, per * world, 8, device))
    model.loss(tokens[rows_of(rank, per)], targets[rows_of(rank, per)]).backward()
    ref.loss(tokens, targets).backward()
    saved = [p.grad.clone() for p in model.parameters()]
    ref_saved = [p.grad.clone() for p in ref.parameters()]

    def restore():
        for p, g in zip(model.parameters(), saved):
            p.grad.copy_(g)
        for p, g in zip(ref.parameters(), ref_saved):
            p.grad.copy_(g)

    max_norm = 1e-3  # far below every norm: clipping scales every gradient
    norms = {}
    for norm_type in (1.0, float("inf"), 3.0, 2.0):
        restore()
        total = mfsdp.clip_grad_norm_(model, max_norm, norm_type=norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        assert ref_total.item() > 10 * max_norm, "the reference norm must exceed max_norm for clipping to act"
        assert rel_err(total, ref_total) <= 1e-5, f"norm_type={norm_type}: total norm {total} vs {ref_total}"
        assert worst_grad_error(model, ref) <= 1e-5, f"norm_type={norm_type}: clipped gradients differ"
        norms[norm_type] = total.item()

    # An iterable (a generator) of some parameters: only those count and get clipped.
    restore()
    subset = {id(p) for p in model.blocks[1].parameters()}
    total = mfsdp.clip_grad_norm_((p for p in model.blocks[1].parameters()), max_norm, norm_type=2.0)
    ref_total = torch.nn.utils.clip_grad_norm_(list(ref.blocks[1].parameters()), max_norm, norm_type=2.0)
    assert rel_err(total, ref_total) <= 1e-5, f"iterable of parameters: total norm {total} vs {ref_total}"
    assert worst_grad_error(model, ref) <= 1e-5, "iterable of parameters: clipped gradients differ"
    for p, g in zip(model.parameters(), saved):
        if id(p) not in subset:
            assert torch.equal(p.grad, g), "a parameter outside the iterable was clipped"

    # A single tensor counts as one parameter (as for torch), not as an iterable of rows.
    restore()
    total = mfsdp.clip_grad_norm_(model.blocks[0].attn.wo.weight, max_norm, norm_type=1.0)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.blocks[0].attn.wo.weight, max_norm, norm_type=1.0)
    assert rel_err(total, ref_total) <= 1e-5, f"a single tensor: total norm {total} vs {ref_total}"
    got, want = model.blocks[0].attn.wo.weight, ref.blocks[0].attn.wo.weight
    assert rel_err(got.grad, expected_shard(want.grad, got)) <= 1e-5, "a single tensor: clipped gradient differs"

    # A non-finite gradient on one rank makes the global norm non-finite on every rank.
    for bad in (float("inf"), float("nan")):
        restore()
        if rank == 0:
            next(p for p in model.parameters() if p.grad.numel()).grad[0] = bad
        expect_error(lambda: mfsdp.clip_grad_norm_(model, max_norm, error_if_nonfinite=True),
                     RuntimeError, "non-finite")
        total = mfsdp.clip_grad_norm_(model, max_norm, error_if_nonfinite=False)
        assert not torch.isfinite(total), f"a {bad} gradient on rank 0 gave a finite norm {total} on rank {rank}"
    return norms


def _state_dict_options(rank: int, world: int, device) -> Dict:
    cfg, model, _ = build_models({"layers": 2}, device)
    model.register_buffer("scale", torch.arange(3.0, device=device))  # a replicated entry
    shard_blocks_and_root(model)
    unit_device = model._fsdp_state.unit.device

    # cpu_offload=False: every tensor stays on the parameters' device, same values, and
    # owns its memory (writing to it leaves the model alone).
    on_device = mfsdp.full_state_dict(model, rank0_only=False, cpu_offload=False)
    offloaded = mfsdp.full_state_dict(model, rank0_only=False)
    assert set(on_device) == set(offloaded)
    for key, value in on_device.items():
        assert value.device == unit_device, f"cpu_offload=False: '{key}' on {value.device}, expected {unit_device}"
        assert offloaded[key].device.type == "cpu", f"cpu_offload=True: '{key}' on {offloaded[key].device}"
        assert torch.equal(value.cpu(), offloaded[key]), f"'{key}' differs between cpu_offload=False and True"
    on_device["blocks.0.attn.wo.weight"].zero_()
    again = mfsdp.full_state_dict(model, rank0_only=False)
    assert torch.equal(again["blocks.0.attn.wo.weight"], offloaded["blocks.0.attn.wo.weight"]), (
        "writing to a cpu_offload=False state dict changed the model")
    rank0_only = mfsdp.full_state_dict(model, cpu_offload=False)  # collective: every rank calls it
    assert (rank0_only == {}) == (rank != 0), "rank0_only: only rank 0 gets the state dict"

    # strict=False, like nn.Module.load_state_dict(strict=False): missing keys keep their
    # values (a whole unit, part of a unit, a buffer), unexpected keys are ignored, the
    # rest is loaded.
    plain = LlamaModel(cfg).to(device)
    plain.register_buffer("scale", torch.zeros(3, device=device))
    plain.load_state_dict(offloaded)
    torch.manual_seed(21)
    donor = LlamaModel(cfg).to(device)
    donor.register_buffer("scale", torch.full((3,), 7.0, device=device))
    partial = {k: v for k, v in donor.state_dict().items()
               if not k.startswith("blocks.0.") and k not in ("blocks.1.mlp.w_down.weight", "scale")}
    partial["not.a.key"] = torch.zeros(2, device=device)
    result = plain.load_state_dict(partial, strict=False)
    assert result.missing_keys and result.unexpected_keys == ["not.a.key"]
    mfsdp.load_full_state_dict(model, partial, strict=False)
    loaded = mfsdp.full_state_dict(model, rank0_only=False)
    for key, value in plain.state_dict().items():
        assert torch.equal(loaded[key].to(device), value), f"strict=False: '{key}' differs from nn.Module's result"
    expect_error(lambda: mfsdp.load_full_state_dict(model, partial), KeyError, "missing keys", "not.a.key")
    wrong = dict(partial, **{"blocks.1.attn.wo.weight": torch.zeros(2, 2)})
    expect_error(lambda: mfsdp.load_full_state_dict(model, wrong, strict=False), ValueError,
                 "'blocks.1.attn.wo.weight' has shape (2, 2)")
    return {"keys": len(on_device), "missing": len(result.missing_keys)}


# ---------------------------------------------------------------- resharding and prefetch controls

def _is_sharded(state) -> bool:
    return state.unit.state == state.unit.state.SHARDED


def reshard_and_prefetch_controls(rank: int, world: int) -> Dict:
    """set_prefetch_depth, set_modules_to_backward_prefetch, set_reshard_after_forward(False)
    under ZeRO-3, and recurse=False on set_reshard_after_forward / set_requires_gradient_sync."""
    device = device_for_backend()
    per = 2
    report = {}
    cfg, model, ref = build_models({"layers": 3}, device)
    shard_blocks_and_root(model)
    # Per-unit prefetch is what is counted here (buckets prefetch whole buckets:
    # test_buckets.py).
    model.set_gather_bucket_bytes(0)
    root = model._fsdp_state
    blocks = [b._fsdp_state for b in model.blocks]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    batches = list(global_batches(cfg, 8, per * world, 8, device))
    index = {s: i for i, s in enumerate(blocks)}
    after_forward = []

    def step(tokens, targets) -> UnitTrace:
        """One training step, traced; the units' sharded flags right after forward go to
        `after_forward`."""
        with UnitTrace([root] + blocks) as trace:
            with UnitTrace.phase("fwd"):
                loss = model.loss(tokens[rows_of(rank, per)], targets[rows_of(rank, per)])
            after_forward[:] = [_is_sharded(s) for s in blocks]
            with UnitTrace.phase("bwd"):
                loss.backward()
        opt.step()
        opt.zero_grad()
        ref.loss(tokens, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        return trace

    def order(trace, phase):
        return [index.get(s, "root") for s in trace.unshards(phase)]

    step(*batches[0])  # records the forward order (and names the units)
    assert after_forward == [True] * 3, "ZeRO-3 default must reshard blocks after forward"

    # set_prefetch_depth on the root: 1 + depth blocks unsharded at once in forward.
    for i, depth in enumerate((0, 2)):
        model.set_prefetch_depth(depth)
        live = step(*batches[1 + i]).max_unsharded(exclude={root})
        assert live["fwd"] == 1 + depth, (
            f"set_prefetch_depth({depth}): {live['fwd']} blocks unsharded at once in forward")
        report[f"depth_{depth}"] = {"fwd": live["fwd"], "bwd": live["bwd"]}

    # set_modules_to_backward_prefetch: without prefetch, backward gathers each block
    # when it is reached (last first); block 2 told to prefetch block 0 gathers it
    # right after itself, before block 1.
    model.set_prefetch_depth(0)
    trace = step(*batches[3])
    assert trace.unshards("bwd") == blocks[::-1], f"backward gathers blocks {order(trace, 'bwd')}"
    model.blocks[2].set_modules_to_backward_prefetch([model.blocks[0]])
    trace = step(*batches[4])
    assert trace.unshards("bwd") == [blocks[2], blocks[0], blocks[1]], (
        f"set_modules_to_backward_prefetch: backward gathers blocks {order(trace, 'bwd')}, expected [2, 0, 1]")
    model.blocks[2].set_modules_to_backward_prefetch([])

    # set_reshard_after_forward(False) under ZeRO-3: blocks stay unsharded from
    # forward to backward, so backward gathers nothing; True restores the default.
    model.set_reshard_after_forward(False)
    trace = step(*batches[5])
    assert after_forward == [False] * 3, f"reshard_after_forward=False: blocks sharded after forward {after_forward}"
    assert trace.unshards("bwd") == [], f"reshard_after_forward=False: backward gathered blocks {order(trace, 'bwd')}"
    assert all(_is_sharded(s) and s.unit.unsharded_storage_bytes == 0 for s in blocks + [root]), (
        "every unit must be resharded after backward")
    model.set_reshard_after_forward(True)
    trace = step(*batches[6])
    assert after_forward == [True] * 3 and len(trace.unshards("bwd")) == 3
    report["parity"] = worst_param_error(model, ref)
    assert report["parity"] <= 1e-5, f"parity across the control changes: {report['parity']}"
    report["recurse"] = _recurse_false(rank, world, device)
    return report


def _nested_llama(device):
    """Every block's MLP is a unit inside its block's unit."""
    cfg, model, ref = build_models({"layers": 3}, device)
    for block in model.blocks:
        mfsdp.fully_shard(block.mlp)
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    return cfg, model, ref


def _recurse_false(rank: int, world: int, device) -> Dict:
    per = 2
    cfg, model, ref = _nested_llama(device)
    batches = list(global_batches(cfg, 4, per * world, 8, device))
    outer = [b._fsdp_state for b in model.blocks]
    inner = [b.mlp._fsdp_state for b in model.blocks]

    def sharded_after_forward(tokens, targets):
        loss = model.loss(tokens[rows_of(rank, per)], targets[rows_of(rank, per)])
        states = [_is_sharded(s) for s in outer], [_is_sharded(s) for s in inner]
        loss.backward()
        return states

    sharded_after_forward(*batches[0])
    model.blocks[1].set_reshard_after_forward(False, recurse=False)
    got = sharded_after_forward(*batches[1])
    assert got == ([True, False, True], [True, True, True]), (
        f"set_reshard_after_forward(False, recurse=False) on block 1: (blocks, mlps) sharded after forward {got}")
    model.blocks[1].set_reshard_after_forward(False)
    got = sharded_after_forward(*batches[1])
    assert got == ([True, False, True], [True, False, True]), f"recurse=True on block 1: {got}"
    model.set_reshard_after_forward(True)

    # set_requires_gradient_sync(False, recurse=False) on block 1: its own parameters
    # accumulate locally (no .grad yet), its MLP and every other unit reduce; the next
    # synced backward completes every gradient, equal to the reference's accumulation.
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    model.blocks[1].set_requires_gradient_sync(False, recurse=False)
    for i, (tokens, targets) in enumerate(batches[2:4]):
        (model.loss(tokens[rows_of(rank, per)], targets[rows_of(rank, per)]) / 2).backward()
        (ref.loss(tokens, targets) / 2).backward()
        if i == 0:
            no_grad = {n for n, p in model.named_parameters() if p.grad is None}
            own = {f"blocks.1.{n}" for n, _ in model.blocks[1].named_parameters() if not n.startswith("mlp.")}
            assert no_grad == own, f"recurse=False: parameters without a reduced gradient {sorted(no_grad)}"
            model.set_requires_gradient_sync(True)
    worst = worst_grad_error(model, ref)
    assert worst <= 1e-5, f"gradients after unsynced + synced backward differ from the reference: {worst}"
    return {"grad_err": worst}


# ---------------------------------------------------------------- subgroup process group (world 4)

def subgroup_process_group(rank: int, world: int) -> Dict:
    """Two groups of two ranks shard the same model independently on different data:
    each group matches a single-process reference trained on its own data (clipping
    included), and the two end apart. Also the errors only a subgroup can reach."""
    from megatron_fsdp_ext.dcp import save_checkpoint

    assert world == 4
    device = device_for_backend()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    color = rank // 2
    group = groups[color]
    cfg, model, ref = build_models({"layers": 2}, device)
    shard_blocks_and_root(model, process_group=group)
    for state in iter_states(model):
        assert (state.unit.world_size, state.unit.shard_index) == (2, rank % 2), (
            f"{state}: sharded over {state.unit.world_size} ranks as index {state.unit.shard_index}, "
            f"expected 2 ranks, index {rank % 2}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    per = 2
    clip = 0.05
    batches = list(global_batches(cfg, 6, per * 2, 8, device))[color::2]  # each group its own data
    norms = []
    for tokens, targets in batches:
        model.loss(tokens[rows_of(rank % 2, per)], targets[rows_of(rank % 2, per)]).backward()
        ref.loss(tokens, targets).backward()
        norm = mfsdp.clip_grad_norm_(model, clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        norms.append(rel_err(norm, ref_norm))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert max(norms) <= 1e-5, f"group {color}: gradient norms differ from its reference: {norms}"
    worst = worst_param_error(model, ref)
    assert worst <= 1e-5, f"group {color}: parameters differ from its reference by {worst}"
    # The groups trained apart: their results differ (the reference proves each is right).
    probe = mfsdp.full_state_dict(model, rank0_only=False)["blocks.0.attn.wo.weight"].to(device).reshape(1, -1)
    everyone = [torch.zeros_like(probe) for _ in range(world)]
    dist.all_gather(everyone, probe)
    assert torch.equal(everyone[0], everyone[1]) and torch.equal(everyone[2], everyone[3])
    assert rel_err(everyone[0], everyone[2]) > 1e-3, "the two groups' models should have diverged"

    # Errors only reachable with a group not spanning the job.
    expect_error(lambda: mfsdp.fully_shard(nn.Linear(4, 4).to(device), process_group=group,
                                           create_all_gather_group=True),
                 ValueError, "create_all_gather_group=True needs a process group spanning all ranks")
    expect_error(lambda: save_checkpoint("/nonexistent/unused", model), NotImplementedError,
                 "sharded over 2 of 4 ranks", "full_state_dict")
    return {"worst": worst, "norm_errs": norms}


# ---------------------------------------------------------------- error paths (world 2)

def error_paths(rank: int, world: int, path: str) -> None:
    """Every user-reachable raise of api.py, config.py, checkpoint.py, dcp.py,
    layerwise.py and clip.py that no other test reaches: the exception type and the
    words of its message that name the problem."""
    device = device_for_backend()
    _api_and_config_errors(device)
    _full_state_dict_errors(device)
    _sharded_checkpoint_errors(rank, world, device, path)
    _layerwise_errors(device)
    _clip_errors(device)


def _api_and_config_errors(device) -> None:
    lin = lambda: nn.Linear(4, 4).to(device)  # noqa: E731
    for depth in (-1, True, 1.5):
        expect_error(lambda: mfsdp.fully_shard(lin(), prefetch_depth=depth), ValueError,
                     f"prefetch_depth must be an int >= 0, got {depth!r}")
    for alignment in (0, -16, 2.5, True):
        expect_error(lambda: mfsdp.fully_shard(lin(), alignment=alignment), ValueError,
                     f"alignment must be a positive int, got {alignment!r}")
    expect_error(lambda: mfsdp.fully_shard(lin(), sharding_strategy="zero3"), ValueError,
                 "unknown sharding_strategy 'zero3'", "'optim_grads_params'")
    expect_error(lambda: mfsdp.fully_shard(lin(), sharding_strategy="optim", reshard_after_forward=True),
                 ValueError, "reshard_after_forward=True contradicts sharding_strategy='optim'")
    same_ranks = dist.new_group(list(range(dist.get_world_size())))  # collective
    expect_error(lambda: mfsdp.fully_shard(lin(), all_gather_group=same_ranks, create_all_gather_group=True),
                 ValueError, "either all_gather_group or create_all_gather_group=True, not both")

    model = mfsdp.fully_shard(nn.Sequential(mfsdp.fully_shard(lin()), lin()))
    plain = lin()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    expect_error(lambda: mfsdp.attach_param_sync(opt, plain), TypeError,
                 "attach_param_sync needs a fully_shard module, got Linear")
    expect_error(lambda: model.set_modules_to_forward_prefetch([model[0], plain]), ValueError,
                 "set_modules_to_forward_prefetch: Linear is not a fully_shard module")
    expect_error(lambda: model.set_modules_to_backward_prefetch(["block"]), ValueError,
                 "set_modules_to_backward_prefetch: str is not a fully_shard module")
    expect_error(lambda: model.set_prefetch_depth(-2), ValueError, "prefetch_depth must be an int >= 0, got -2")
    kept = mfsdp.fully_shard(lin(), sharding_strategy="optim_grads")
    expect_error(lambda: kept.set_reshard_after_forward(True), ValueError,
                 "set_reshard_after_forward(True)", "sharding_strategy='optim_grads'")

    expect_error(lambda: mfsdp.fully_shard_model(nn.Sequential(lin()), mfsdp.FSDPConfig(),
                                                 fsdp_unit_modules=[nn.Linear(2, 2)]),
                 TypeError, "fsdp_unit_modules must hold nn.Module classes, got Linear(")


def _sharded_llama_with_buffer(device, scale_numel: int = 3, **build_opts):
    cfg, model, _ = build_models(dict({"layers": 2}, **build_opts), device)
    model.register_buffer("scale", torch.ones(scale_numel, device=device))  # replicated state
    return cfg, shard_blocks_and_root(model)


def _full_state_dict_errors(device) -> None:
    cfg, model = _sharded_llama_with_buffer(device)
    good = mfsdp.full_state_dict(model, rank0_only=False)
    # After unshard() both reshard first, as FSDP2's state-dict hooks do, and work on the shards.
    for call in (lambda: mfsdp.full_state_dict(model, rank0_only=False), lambda: mfsdp.load_full_state_dict(model, good)):
        model.blocks[0].unshard()
        again = call()
        assert model.blocks[0]._fsdp_state.slots_hold is SlotsHold.SHARDED
        if again is not None:
            assert set(again) == set(good) and all(torch.equal(again[k], good[k]) for k in good)
    expect_error(lambda: mfsdp.load_full_state_dict(model, dict(good, bogus=torch.zeros(1))), KeyError,
                 "unexpected keys ['bogus']")
    missing = {k: v for k, v in good.items() if k != "norm.weight"}
    missing["bogus"] = torch.zeros(1)
    expect_error(lambda: mfsdp.load_full_state_dict(model, missing), KeyError,
                 "missing keys ['norm.weight']; unexpected keys ['bogus']")
    expect_error(lambda: mfsdp.load_full_state_dict(model, dict(good, **{"blocks.1.attn.wo.weight": torch.zeros(4, 8)})),
                 ValueError, "'blocks.1.attn.wo.weight' has shape (4, 8), expected (32, 32)")
    expect_error(lambda: mfsdp.load_full_state_dict(model, dict(good, scale=torch.zeros(4))), ValueError,
                 "'scale' has shape (4,), expected (3,)")


def _sharded_checkpoint_errors(rank: int, world: int, device, path: str) -> None:
    """Checkpoints that save_checkpoint itself never writes are made with dcp.save from
    an edited sharded_state_dict(), or from the earlier flat format's entries."""
    import torch.distributed.checkpoint as dcp

    from harness.flat_format import flat_state_dict
    from megatron_fsdp_ext.dcp import load_checkpoint, save_checkpoint, sharded_state_dict

    cfg, model = _sharded_llama_with_buffer(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    model.loss(tokens, tokens).backward()
    opt.step()

    # Inside backward (a unit's parameters unsharded for it) both refuse, naming the unit.
    refused = []

    def during_backward(module, grad_input, grad_output):
        for call in (lambda: save_checkpoint(path + "/never", model), lambda: sharded_state_dict(model)):
            try:
                call()
            except RuntimeError as e:
                refused.append(str(e))

    handle = model.blocks[0].register_full_backward_hook(during_backward)
    model.loss(tokens, tokens).backward()
    handle.remove()
    opt.zero_grad()
    assert len(refused) == 2 and all("has its unsharded parameters installed" in e for e in refused), refused
    stranger = torch.optim.AdamW(params + [nn.Parameter(torch.zeros(2, 5, device=device))], lr=1e-3)
    expect_error(lambda: save_checkpoint(path + "/never", model, stranger), ValueError,
                 "the optimizer holds a parameter that is not in the module (shape (2, 5))")

    # Flat format: without the stored shapes, a parameter of another numel is caught by its size.
    no_shapes = flat_state_dict(model)
    del no_shapes["meta.param_shapes"]
    with warnings_silenced():
        dcp.save(no_shapes, checkpoint_id=path + "/no_shapes")
    _, wider = _sharded_llama_with_buffer(device, ffn=96)
    expect_error(lambda: load_checkpoint(path + "/no_shapes", wider), ValueError,
                 "'model.blocks.0.mlp.w_gate_up.weight' holds 5632 elements", "shape (192, 32) (6144 elements)")
    # A replicated entry (buffer) of another shape.
    save_checkpoint(path + "/full", model, opt)
    _, longer = _sharded_llama_with_buffer(device, scale_numel=4)
    expect_error(lambda: load_checkpoint(path + "/full", longer), ValueError,
                 "'model.scale' has shape (3,)", "the model's has (4,)")

    # Optimizer state that names no parameter, or has another numel than its parameter:
    # in the flat format, and in torch's state dicts.
    def save_with(key: str, numel: int, where: str) -> str:
        edited = flat_state_dict(model, opt)
        edited[key] = torch.zeros(numel, device=device)
        with warnings_silenced():
            dcp.save(edited, checkpoint_id=path + where)
        return path + where

    stray = save_with("optim.state.nope.exp_avg", 3, "/stray")
    expect_error(lambda: load_checkpoint(stray, model, opt), KeyError,
                 "'optim.state.nope.exp_avg'", "belongs to no parameter")
    resized = save_with("optim.state.blocks.0.attn.wo.weight.exp_avg", 5, "/resized")
    expect_error(lambda: load_checkpoint(resized, model, opt), ValueError,
                 "'optim.state.blocks.0.attn.wo.weight.exp_avg' holds 5 elements",
                 "parameter 'blocks.0.attn.wo.weight' has shape (32, 32)")

    def save_edited(name: str, entry: dict, where: str) -> str:
        edited = sharded_state_dict(model, opt)
        edited["optimizer"]["state"].setdefault(name, {}).update(entry)
        dcp.save(edited, checkpoint_id=path + where)
        return path + where

    stray = save_edited("nope", {"exp_avg": torch.zeros(3, device=device)}, "/stray2")
    expect_error(lambda: load_checkpoint(stray, model, opt, verify=False), KeyError,
                 "in the checkpoint but not in the optimizer: ['optimizer.state.nope.exp_avg']")
    resized = save_edited("blocks.0.attn.wo.weight", {"exp_avg": torch.zeros(5, device=device)}, "/resized2")
    expect_error(lambda: load_checkpoint(resized, model, opt, verify=False), ValueError,
                 "'optimizer.state.blocks.0.attn.wo.weight.exp_avg' has shape (5,)", "the model's has (32, 32)")

    # Optimizer groups that differ from the checkpoint's.
    half = len(params) // 2
    two_groups = torch.optim.AdamW([{"params": params[:half]}, {"params": params[half:]}], lr=1e-3)
    first_extra = sorted([n for n, _ in model.named_parameters()][half:])[0]  # the error names the first, sorted
    expect_error(lambda: load_checkpoint(path + "/full", model, two_groups), KeyError,
                 f"optimizer group 0 in the checkpoint has parameter '{first_extra}'", "not in this optimizer's group 0")
    save_checkpoint(path + "/two_groups", model, two_groups)
    first_group_only = torch.optim.AdamW(params[:half], lr=1e-3)
    expect_error(lambda: load_checkpoint(path + "/two_groups", model, first_group_only), ValueError,
                 "the checkpoint's optimizer has 2 parameter groups, this optimizer has 1")


def warnings_silenced():
    """DCP warns that ShardedTensor is deprecated (see dcp_flat.quiet)."""
    from megatron_fsdp_ext.checkpoint.dcp_flat import quiet

    return quiet()


def _layerwise_errors(device) -> None:
    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer

    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1) if ps else None  # noqa: E731
    lin = lambda: nn.Linear(4, 4).to(device)  # noqa: E731
    expect_error(lambda: LayerwiseDistributedOptimizer(lin(), sgd, grad_reduce="allreduce"), ValueError,
                 "grad_reduce must be 'reduce_scatter' or 'all_reduce', got 'allreduce'")
    for size in (0, 2.5):
        expect_error(lambda: LayerwiseDistributedOptimizer(lin(), sgd, bucket_size=size), ValueError,
                     f"bucket_size must be a positive int (elements), got {size!r}")
    expect_error(lambda: LayerwiseDistributedOptimizer(lin(), sgd, gather_algo="FAST"), ValueError,
                 "gather_algo must be one of AUTO, GROUPED, PADDED; got 'FAST'")
    frozen = lin().requires_grad_(False)
    expect_error(lambda: LayerwiseDistributedOptimizer(frozen, sgd), ValueError, "got no parameters that require grad")
    foreign = nn.Parameter(torch.zeros(3, device=device))
    expect_error(lambda: LayerwiseDistributedOptimizer(lin(), lambda ps: torch.optim.SGD(list(ps) + [foreign], lr=0.1)),
                 ValueError, "optimizer_factory must only use the parameters it was given")
    sharded = nn.Sequential(mfsdp.fully_shard(lin()))
    expect_error(lambda: LayerwiseDistributedOptimizer(sharded, sgd), ValueError,
                 "parameter '0.weight' is sharded by fully_shard")
    lopt = LayerwiseDistributedOptimizer(lin(), sgd)
    expect_error(lambda: lopt.step(closure=lambda: 0.0), NotImplementedError, "does not take a closure")
    expect_error(lambda: lopt.load_state_dict({}), KeyError, "needs a 'state' entry")


def _clip_errors(device) -> None:
    # Units over two different process groups (same ranks, as MoE's expert and dense
    # meshes can be): the norm combines each over its own group, and is the global one.
    other = dist.new_group(list(range(dist.get_world_size())))  # collective
    model = nn.Sequential(mfsdp.fully_shard(nn.Linear(4, 4).to(device), process_group=other), nn.Linear(4, 4).to(device))
    mfsdp.fully_shard(model)
    model(torch.randn(2, 4, device=device)).sum().backward()
    with torch._C.DisableTorchFunctionSubclass():  # every piece is disjoint: one sum over the job
        local = sum(p.grad.double().square().sum() for p in model.parameters())
        dist.all_reduce(local)
    expected = local.sqrt().item()
    got = mfsdp.clip_grad_norm_(model, 1e9)
    assert abs(got.item() - expected) <= 1e-6 * expected, (got.item(), expected)


# ---------------------------------------------------------------- communication buffers

def _group_allocates(state, device: torch.device) -> bool:
    """What torch says of the unit's group: whether its backend allocates `device` memory
    (FSDP2 asks the same before taking its buffers from it)."""
    if device.type != "cuda" or state.process_group.size() == 1:
        return False
    backend = state.process_group._get_backend(device)
    return bool(getattr(backend, "supports_tensor_alloc", lambda _: False)(device))


def _comm_buffer_allocations(snapshot, device: torch.device, sizes, start: int = 0) -> List[tuple]:
    """(bytes, pool id) of every allocation of one of `sizes` bytes in the allocator's
    trace from entry `start` on: the pool is that of the segment holding it (0, 0 is
    torch's default pool)."""
    segments = [(s["address"], s["address"] + s["total_size"], tuple(s["segment_pool_id"]))
                for s in snapshot["segments"] if s["device"] == device.index]
    found = []
    for e in snapshot["device_traces"][device.index][start:]:
        if e["action"] == "alloc" and e["size"] in sizes:
            pool = next((p for lo, hi, p in segments if lo <= e["addr"] < hi), None)
            found.append((e["size"], pool))
    return found


def comm_buffers_from_group(rank: int, world: int, when: str) -> Dict:
    """set_allocate_memory_from_process_group_for_comm(True) on every unit, `when`
    "before_root" (before the first forward) or "after_root" (after one step), or
    torchtitan's enable_fsdp_symm_mem before the first forward ("symm_mem": force-sum
    reductions and set_symm_mem_for_comm, which takes the same pool), then False
    again for a last step: gradients match the single-process reference at every step;
    where torch says the group's backend allocates (NCCL on a multicast-capable GPU),
    every all-gather output and reduce-scatter input of the third step lies in the
    group's pool and every one of the fourth step in torch's default pool; elsewhere the
    caching allocator stays, with one warning naming the backend."""
    import warnings

    device = device_for_backend()
    cfg, model, ref = build_models({}, device)
    shard_blocks_and_root(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    states = [s for s in iter_states(model) if s.unit is not None]

    def switch(on: bool):
        if on and when == "symm_mem":
            # torchtitan's own switch (parallelism.enable_fsdp_symm_mem): force-sum reductions
            # and set_symm_mem_for_comm() on every FSDPModule. The GPU machines lack
            # torchtitan: there the same two calls, as its function makes them.
            try:
                from torchtitan.distributed.fsdp import enable_fsdp_symm_mem
            except ImportError:
                for m in model.modules():
                    if isinstance(m, torch.distributed.fsdp.FSDPModule):
                        m.set_force_sum_reduction_for_comms(True)
                        m.set_symm_mem_for_comm()
            else:
                enable_fsdp_symm_mem(model)
            return
        for m in model.modules():
            if isinstance(m, mfsdp.FSDPModule):
                m.set_allocate_memory_from_process_group_for_comm(on)

    expect_error(lambda: model.set_allocate_memory_from_process_group_for_comm(1), TypeError, "expects a bool")
    # Megatron-FSDP's spelling: FSDPConfig(nccl_ub=True) switches every unit it makes.
    expect_error(lambda: mfsdp.FSDPConfig(nccl_ub=1), TypeError, "nccl_ub must be a bool")
    configured = mfsdp.fully_shard_model(build_models({}, device)[1], mfsdp.FSDPConfig(nccl_ub=True),
                                         fsdp_unit_modules=[Block])
    assert all(s.options.comm_buffers_from_group for s in iter_states(configured))
    assert len(list(iter_states(configured))) == cfg.n_layers + 1
    batches = list(global_batches(cfg, 4, 2 * world, 8, device))
    rows = rows_of(rank, 2)
    if when == "before_root":
        switch(True)
    worst = 0.0
    snapshots = []  # the allocator's trace after step 2 (on) and after step 3 (off again)
    # The warning comes at the switch: in the setter, or at the first forward.
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        for step, (tokens, targets) in enumerate(batches):
            if (step == 1 and when == "after_root") or (step == 0 and when == "symm_mem"):
                switch(True)
            if step == 3:
                switch(False)
            traced = device.type == "cuda" and step >= 2
            if traced and step == 2:
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            model.loss(tokens[rows], targets[rows]).backward()
            ref.loss(tokens, targets).backward()
            worst = max(worst, worst_grad_error(model, ref))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if traced:
                torch.cuda.synchronize()
                snapshots.append(torch.cuda.memory._snapshot())
            if traced and step == 3:
                torch.cuda.memory._record_memory_history(enabled=None)
            if step == 2:
                flags_on = [(s.options.comm_buffers_from_group, s.unit.gather_buffer_from_group,
                             s.unit.reduce_buffer_from_group) for s in states]
    messages = [str(w.message) for w in recorded]
    assert worst < 1e-5, f"gradients differ from the single-process reference by {worst:.2e}"

    allocates = [_group_allocates(s, device) for s in states]
    assert len(set(allocates)) == 1, allocates
    expected = allocates[0]
    assert flags_on == [(True, expected, expected)] * len(states), (expected, flags_on)
    for s in states:
        assert not s.options.comm_buffers_from_group
        assert s.unit.comm_buffer_source == mfsdp._C.CommBufferSource.CACHING_ALLOCATOR
        assert not s.unit.gather_buffer_from_group and not s.unit.reduce_buffer_from_group
    warned = [m for m in messages if "does not allocate" in m]
    substituted = [m for m in messages if "instead of symmetric-memory windows" in m]
    assert len(substituted) == (len(states) if when == "symm_mem" else 0), messages
    if when == "symm_mem":
        expect_error(lambda: model.set_symm_mem_for_comm("NVSHMEM"), ValueError, "'NCCL' only")
    if expected:
        assert not warned, warned
        # fp32 throughout: a unit's gathered buffer and its packed gradients are both
        # total_numel x 4 bytes, and nothing else of the step has that size.
        sizes = {s.unit.layout.total_numel * 4 for s in states}
        on, both = snapshots
        first_off = len(on["device_traces"][device.index])
        found_on = _comm_buffer_allocations(on, device, sizes)
        found_off = _comm_buffer_allocations(both, device, sizes, start=first_off)
        assert len(found_on) >= 2 * len(states) and len(found_off) >= 2 * len(states), (found_on, found_off)
        outside = [f for f in found_on if f[1] in (None, (0, 0))]
        assert not outside, f"communication buffers outside the group's pool: {outside} of {found_on}"
        inside = [f for f in found_off if f[1] != (0, 0)]
        assert not inside, f"switched off, yet buffers in the group's pool: {inside} of {found_off}"
    else:
        backend = repr(states[0].process_group.name())
        assert len(warned) == 1 and backend in warned[0], messages
    return {"from_group": expected, "worst_grad_error": worst, "warnings": messages}
