"""Distributed test workers: each trains a sharded model and a single-process
reference (same seed, same global batch) side by side and compares them.

Workers run under run_distributed on Gloo (CPU) and NCCL (GPU) alike.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.core.states import SlotsHold

from .launcher import TEST_DEVICE_ENV
from .observe import UnitTrace


class TinyBlock(nn.Module):
    """A Linear(8, 8) and a ReLU: the smallest unit the memory and parameter-object tests shard."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class TinyStack(nn.Module):
    """`depth` blocks of width 8 (`block()` each; a unit each in the tests that shard them)
    and a Linear(8, 1) head."""

    def __init__(self, block=TinyBlock, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(depth)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class ResidualTokenNet(nn.Module):
    """Token embedding, residual Linear-Tanh-Linear blocks (`hidden` wide), a LayerNorm, a
    head and a scalar buffer: small shapes whose flat pieces cross row boundaries at worlds
    2 and 4 (the state-dict tests)."""

    def __init__(self, vocab: int, dim: int, hidden: int, inner_bias: bool = True, depth: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim, bias=inner_bias))
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h) * self.scale)


def torchrun_environment(rank: int, world: int, **extra: str) -> None:
    """torchrun's environment variables for this rank of run_distributed's job (and
    `extra` ones): clients that read the job from the environment (Accelerate, Lightning)
    then join the process group already set up instead of taking themselves for a single
    process."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      **extra)


def device_for_backend() -> torch.device:
    """Where this rank's tensors live: as run_distributed(device=...) said, else cuda
    under NCCL and the CPU otherwise."""
    wanted = os.environ.get(TEST_DEVICE_ENV)
    if wanted == "cuda" or (wanted is None and dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def flat_piece(t):
    """This rank's piece of a sharded gradient (or parameter) as a flat plain tensor, a
    view (writes land in it); None stays None. The tests read pieces this way: flattening a
    sharded gradient itself is refused between backward and the step, where its result
    would pass for the whole gradient's (use `to_local()` in user code)."""
    if t is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().reshape(-1)


def expect_error(fn, exc_type, *fragments: str) -> None:
    """fn() must raise exc_type whose message contains every fragment."""
    try:
        fn()
    except exc_type as e:
        for f in fragments:
            assert f in str(e), f"{f!r} not in the error message: {e}"
        return
    raise AssertionError(f"no {exc_type.__name__} raised (expected one mentioning {fragments})")


def checkpoint_snapshot(model, opt=None):
    """Full parameters (every rank) and this rank's optimizer state, cloned: what a
    checkpoint test compares before and after a save or load."""
    full = {k: v.clone() for k, v in mfsdp.full_state_dict(model, rank0_only=False).items()}
    state = {}
    if opt is not None:
        for i, p in enumerate(opt.param_groups[0]["params"]):
            for key, value in opt.state.get(p, {}).items():
                state[f"{i}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return full, state


def assert_same_snapshot(got, expected, what):
    (gf, gs), (ef, es) = got, expected
    assert set(gf) == set(ef) and set(gs) == set(es), what
    for k in ef:
        assert torch.equal(gf[k], ef[k]), f"{what}: parameter '{k}' differs"
    for k in es:
        assert torch.equal(torch.as_tensor(gs[k]), torch.as_tensor(es[k])), f"{what}: optimizer state '{k}' differs"


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped): what they keep
    alive, views of one flat buffer counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are empty or zero), of this rank's values:
    a DTensor (a gradient piece, which reduces its statistics over the ranks when read)
    counts by its local tensor, so no rank waits for another."""
    from torch.distributed.tensor import DTensor

    a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    diff = (a - b).norm().item()
    denom = b.norm().item()
    return diff / denom if denom > 0 else diff


class _ReusedBlock(LlamaModel):
    """Runs block 1 twice (weight sharing): one unit, two forward calls, one backward."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = block(x)
        return self.head(self.norm(x))


def build_models(opts: Dict, device: torch.device):
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=opts.get("vocab", 128), d_model=opts.get("d_model", 32), n_layers=opts.get("layers", 3),
        n_heads=4, ffn_hidden=opts.get("ffn", 88), tie_embeddings=opts.get("tie", False),
    )
    model = (_ReusedBlock if opts.get("reuse_block") else LlamaModel)(cfg)
    if opts.get("unused"):
        # Registered in a block but never called: its grads must stay None.
        model.blocks[0].unused = nn.Linear(cfg.d_model, 7)
    if opts.get("frozen"):
        model.blocks[1].attn.wqkv.weight.requires_grad_(False)
        model.norm.weight.requires_grad_(False)
    model = model.to(device)
    ref = copy.deepcopy(model)
    return cfg, model, ref


def shard_blocks_and_root(model: LlamaModel, fully_shard=None, **kwargs) -> LlamaModel:
    """`fully_shard` (ours by default; torch's FSDP2 for a reference) on every block,
    then on the root, with the same keyword arguments."""
    fully_shard = fully_shard or mfsdp.fully_shard
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_piece(sharded_param: torch.Tensor):
    """(unit state, parameter index, this rank's ShardSlice) of a sharded parameter."""
    owner = getattr(sharded_param, "_mfsdp_owner", None)
    assert owner is not None, "not a parameter of any fully_shard unit"
    state = owner()
    index = next(i for i, q in enumerate(state.sharded_params) if q is sharded_param)
    return state, index, state.unit.layout.shard_slices(state.unit.shard_index)[index]


def shard(model: LlamaModel, opts: Dict) -> LlamaModel:
    mp = mfsdp.MixedPrecisionPolicy(
        param_dtype=opts.get("param_dtype"), reduce_dtype=opts.get("reduce_dtype")
    )
    groups = {}
    if opts.get("explicit_groups"):  # collective: every rank shards the same modules in order
        world_ranks = list(range(dist.get_world_size()))
        groups = {"all_gather_group": dist.new_group(world_ranks), "reduce_scatter_group": dist.new_group(world_ranks)}
    kw = dict(
        **groups,
        mp_policy=mp,
        reshard_after_forward=opts.get("reshard_after_forward"),
        sharding_strategy=opts.get("strategy", "optim_grads_params"),
        prefetch_depth=opts.get("prefetch_depth", 1),
        gather_bucket_bytes=opts.get("gather_bucket_bytes", 0),
        reduce_bucket_bytes=opts.get("reduce_bucket_bytes", 0),
        create_all_gather_group=opts.get("create_all_gather_group"),
        check_for_nan_in_grad=opts.get("check_for_nan_in_grad", False),
        timeout=opts.get("timeout"),
    )
    offload = opts.get("offload")
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = CPUOffloadPolicy(pin_memory=opts.get("pin_memory", True))
        if offload == "blocks":  # partial offload: the root's embedding and head stay on the device
            for block in model.blocks:
                mfsdp.fully_shard(block, offload_policy=policy, **kw)
            return mfsdp.fully_shard(model, **kw)
        kw["offload_policy"] = policy
    return shard_blocks_and_root(model, **kw)


def make_optimizer(params, opts: Dict, ours: bool = False):
    """opts['optimizer'] over `params`; 'cpu_adamw' is our CPUAdamW for the sharded model
    (`ours`) and for an FSDP2 reference (bf16: the same fp32 arithmetic, so gathered bf16
    weights match bitwise), torch's AdamW, same settings, for a plain fp32 reference."""
    kind = opts.get("optimizer", "adamw")
    if kind in ("cpu_adamw", "cpu_adamw_overlap"):
        from megatron_fsdp_ext.optim import CPUAdamW

        same = ours or opts.get("param_dtype") is not None
        if not same:
            return torch.optim.AdamW(params, lr=opts.get("lr", 1e-4), weight_decay=0.1)
        return CPUAdamW(params, lr=opts.get("lr", 1e-4), weight_decay=0.1,
                        overlap_step=ours and kind == "cpu_adamw_overlap")
    if kind == "adamw":
        fused = opts.get("fused", False)
        # lr 1e-4: Adam's g/sqrt(v) amplifies fp32 rounding of near-zero gradients
        # (reduction order differs from the reference) in proportion to lr; the
        # parity test also checks the parameters moved far more than its tolerance.
        return torch.optim.AdamW(params, lr=opts.get("lr", 1e-4), weight_decay=0.1, fused=fused or None)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    raise ValueError(kind)


def global_batches(cfg, steps: int, batch: int, seq: int, device):
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        yield data[:, :-1].to(device), data[:, 1:].to(device)


# Option sets for train_parity, shared by the Gloo and NCCL suites.
# A bf16 param_dtype makes the reference FSDP2 under the same policy (see train_parity).
# AdamW's update does not change when every gradient is scaled, SGD's does: the bf16
# scenarios also train with SGD (momentum) and clipping, in the same processes.
_SGD_CLIP = {"optimizer": "sgd", "clip": 0.05}
PARITY_SCENARIOS = {
    "adamw": {},
    "sgd": {"optimizer": "sgd"},
    "tied": {"tie": True},
    "unused_params": {"unused": True},
    "frozen_params": {"frozen": True},
    "grad_accumulation": {"micro_batches": 2},
    "grads_accumulate_across_synced_backwards": {"micro_batches": 2, "sync_every_micro": True},
    "clip_grad_norm": {"clip": 0.05},
    "no_reshard_after_forward": {"reshard_after_forward": False},
    "explicit_all_gather_and_reduce_scatter_groups": {"explicit_groups": True},
    "block_called_twice": {"reuse_block": True},
    "bf16_mixed_precision": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "lr": 1e-3, "extra_runs": [_SGD_CLIP],
    },
    "bf16_reduce": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "lr": 1e-3, "extra_runs": [_SGD_CLIP],
    },
}


def step_with_reference(model, opt, ref, ref_opt, tokens, targets, rows) -> None:
    """One distributed step on this rank's `rows` of the global batch, and the
    single-process reference's step on the whole batch."""
    model.loss(tokens[rows], targets[rows]).backward()
    opt.step()
    opt.zero_grad()
    ref.loss(tokens, targets).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def shard_with_fsdp2(model: LlamaModel, opts: Dict) -> LlamaModel:
    """The same units as shard(), built by PyTorch's FSDP2 under the same mixed-precision
    policy: the reference for low-precision parity. FSDP2 has no ZeRO-1/2 or no_shard
    mode of its own; the gradient and update math of every strategy is the same."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=opts.get("param_dtype"), reduce_dtype=opts.get("reduce_dtype"))
    kw = {}
    if opts.get("offload") and opts.get("optimizer", "").startswith("cpu_adamw") and \
            device_for_backend().type == "cuda":
        # CPUAdamW steps host tensors: FSDP2's own offload gives it those (and is tested with it).
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    model = shard_blocks_and_root(model, fully_shard=fully_shard, mp_policy=mp, **kw)
    if dist.get_backend() == "gloo" and device_for_backend().type == "cuda":
        # FSDP2 divides inside the collective (AVG / PREMUL_SUM), which Gloo refuses for
        # CUDA tensors; SUM, then its own division, is the same mean. Per unit (not recursive).
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 parameter, gradient or norm) as one full tensor (collective).
    torch's full_tensor() crashes with CUDA tensors on Gloo (its functional all-gather,
    torch 2.11: SIGSEGV); there the library's plain-collective gather serves, which
    test_backends checks against full_tensor() on the CPU."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.to_local().device.type != t.device_mesh.device_type:
        # FSDP2's offloaded parameters and gradients: host local shards on a device mesh.
        from torch.distributed.tensor import DTensor
        t = DTensor.from_local(t.to_local().to(t.device_mesh.device_type), t.device_mesh, t.placements,
                               shape=t.shape, stride=t.stride())
    if dist.get_backend(t.device_mesh.get_group(0)) == "gloo" and t.device.type == "cuda":
        from megatron_fsdp_ext.core.state_dict import gather_dtensor
        return gather_dtensor(t)
    return t.full_tensor()


def gather_full_grads(model: nn.Module, replicated: bool) -> Dict[str, torch.Tensor]:
    """Every parameter's full gradient, flattened, on CPU (None where it is None), from
    the sharded `.grad`s of all ranks placed by their units' layouts. Checks the pieces
    on the way: a gradient is None on every rank or on none; sharded pieces tile the
    parameter exactly once; replicated (no_shard) gradients are whole on every rank,
    and this rank's own copy is returned (each rank checks its own)."""
    local = {}
    for name, p in model.named_parameters():
        state, idx, piece = shard_piece(p)
        grad = None if p.grad is None else flat_piece(p.grad).cpu().clone()
        local[name] = (piece.param_offset, state.unit.layout.numels[idx], grad)
    pieces_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(pieces_by_rank, local)
    full = {}
    for name, (_, numel, own_grad) in local.items():
        pieces = [by_rank[name] for by_rank in pieces_by_rank]
        none_on = [r for r, (_, _, g) in enumerate(pieces) if g is None]
        assert not none_on or len(none_on) == len(pieces), f"'{name}': gradient None on ranks {none_on} only"
        if none_on:
            full[name] = None
        elif replicated:
            for r, (offset, _, g) in enumerate(pieces):
                assert offset == 0 and g.numel() == numel, (
                    f"'{name}': rank {r} holds {g.numel()} of {numel} gradient elements from offset {offset}")
            full[name] = own_grad
        else:
            grad = torch.zeros(numel, dtype=own_grad.dtype)
            covered = torch.zeros(numel, dtype=torch.int32)
            for offset, _, g in pieces:
                grad[offset: offset + g.numel()] = g
                covered[offset: offset + g.numel()] += 1
            assert bool((covered == 1).all()), (
                f"'{name}': the ranks' gradient pieces cover elements {covered.min().item()} to "
                f"{covered.max().item()} times, not exactly once")
            full[name] = grad
    return full


def check_grads(step: int, model: nn.Module, ref: nn.Module, replicated: bool, tol: float) -> float:
    """After the last backward of a step, before clipping and the optimizer: every
    parameter's full gradient equals the reference's. Returns the largest rel. error."""
    ours = gather_full_grads(model, replicated)
    theirs = {}
    for name, p in ref.named_parameters():
        theirs[name] = None if p.grad is None else _full(p.grad).detach().reshape(-1).cpu()
    assert set(ours) == set(theirs), f"parameter names differ: {sorted(set(ours) ^ set(theirs))}"
    worst = 0.0
    for name, want in theirs.items():
        got = ours[name]
        assert (got is None) == (want is None), (
            f"step {step}: gradient of '{name}' is {'None' if got is None else 'set'} but the reference's is "
            f"{'None' if want is None else 'set'}")
        if want is None:
            continue
        assert got.numel() == want.numel(), f"'{name}': {got.numel()} gradient elements vs {want.numel()}"
        assert want.norm() > 0, f"step {step}: the reference gradient of '{name}' is zero; the check is vacuous"
        err = rel_err(got, want)
        assert err <= tol, f"step {step}: gradient of '{name}' rel err {err:.3e} > {tol}"
        worst = max(worst, err)
    return worst


def parity_tolerances(opts: Dict, world: int) -> Dict[str, float]:
    """Relative-error bounds of train_parity, from what differs from its reference.

    - fp32 (plain reference), or bf16 params with fp32 reduction (FSDP2 reference): only
      the order of fp32 sums differs (the ranks' partial gradients, the clip norm's
      pieces); measured <= 2e-9 for gradients, 1e-8 for parameters.
    - bf16 reduction, world 2: a + b rounds alike in either order, and FSDP2's average
      and our sum-then-halve are exact scalings: bitwise-equal gradients (measured).
    - bf16 reduction, world > 2: Gloo sums each element in an order set by its position
      in the flat buffer, which differs between our layout and FSDP2's, so each bf16 sum
      may round apart by an ulp (2^-8): measured 3.9e-3 at step 0, 1.4e-2 by step 5 as
      parameters drift. A gradient scaled by 2, or left unreduced, errs by ~1. AdamW
      turns such differences into sign flips of near-zero updates (parameters 6e-3 apart
      after 5 steps), so parameters are bounded by a fraction of how far they moved.
    """
    reduce_dtype = opts.get("reduce_dtype") or opts.get("param_dtype") or torch.float32
    if reduce_dtype == torch.float32 or world <= 2:
        return {"grad": 1e-5, "param": 1e-5, "loss": 1e-5, "norm": 1e-5}
    return {"grad": 5e-2, "param_of_update": 0.15, "loss": 1e-3, "norm": 5e-2}


def train_parity(rank: int, world: int, opts: Dict) -> Dict:
    """Train the sharded model and a reference side by side for opts['steps'] steps on
    the same data and check: at every step each rank's local loss and every parameter's
    full gradient (after the last backward, before clipping and the step), the gradient
    norm when clipping; at the end every parameter.

    fp32: the reference is the plain model on the whole global batch (the gradient of
    the mean loss is the mean of the ranks' gradients). A low-precision param_dtype:
    FSDP2 under the same policy, ranks and per-rank data; a plain fp32 model would differ
    by bf16 rounding (~1e-2), enough to hide a wrongly scaled gradient of that size.
    opts['extra_runs']: more option overrides trained and checked in the same processes."""
    extra_runs = opts.get("extra_runs", ())
    if extra_runs:
        base = {k: v for k, v in opts.items() if k != "extra_runs"}
        result = train_parity(rank, world, base)
        result["extra_runs"] = [train_parity(rank, world, dict(base, **extra)) for extra in extra_runs]
        return result

    device = device_for_backend()
    cfg, model, ref = build_models(opts, device)
    init_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    shard(model, opts)
    fsdp2_reference = opts.get("param_dtype") is not None
    if fsdp2_reference:
        shard_with_fsdp2(ref, opts)
    replicated = opts.get("strategy") == "no_shard"
    opt = make_optimizer(model.parameters(), opts, ours=True)
    ref_opt = make_optimizer(ref.parameters(), opts)
    micro = opts.get("micro_batches", 1)
    per_rank = opts.get("batch", 4)
    batch = per_rank * world
    seq = opts.get("seq", 16)
    clip = opts.get("clip")
    tol = parity_tolerances(opts, world)
    local_losses, ref_local_losses, losses, ref_losses, norms, ref_norms = [], [], [], [], [], []
    grad_errs = []  # per step: the largest gradient rel. error over the parameters
    for tokens, targets in global_batches(cfg, opts.get("steps", 5), batch * micro, seq, device):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        local = ref_local = ref_total = 0.0
        for m in range(micro):
            start = m * batch + rank * per_rank
            rows = slice(start, start + per_rank)  # this rank's rows of micro-batch m
            # sync_every_micro: reduce every backward, accumulating into existing .grad;
            # finish_grad_sync: no backward syncs, finish_grad_sync() reduces after the last.
            sync = opts.get("sync_every_micro", False) or (m == micro - 1 and not opts.get("finish_grad_sync"))
            if fsdp2_reference:
                ref.set_requires_gradient_sync(sync)
                ref_loss = ref.loss(tokens[rows], targets[rows]) / micro
                ref_loss.backward()
                ref_local += ref_loss.item()
            else:
                # The whole micro-batch, as one process would train; and the loss on our rows.
                whole = slice(m * batch, (m + 1) * batch)
                ref_loss = ref.loss(tokens[whole], targets[whole]) / micro
                ref_loss.backward()
                ref_total += ref_loss.item()
                with torch.no_grad():
                    ref_local += ref.loss(tokens[rows], targets[rows]).item() / micro
            model.set_requires_gradient_sync(sync)
            loss = model.loss(tokens[rows], targets[rows]) / micro
            loss.backward()
            local += loss.item()
        if opts.get("finish_grad_sync"):  # Megatron's spelling; what pipelining's REDUCE_GRAD does
            model.set_requires_gradient_sync(True)
            model.finish_grad_sync()
        local_losses.append(local)
        ref_local_losses.append(ref_local)
        if not fsdp2_reference:
            t = torch.tensor([local], device=device, dtype=torch.float64)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            ref_losses.append(ref_total)
        grad_errs.append(check_grads(len(grad_errs), model, ref, replicated, tol["grad"]))
        if clip:
            ref_norms.append(_full(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)).item())
            norms.append(mfsdp.clip_grad_norm_(model, clip).item())
        ref_opt.step()
        opt.step()

    full = mfsdp.full_state_dict(model, rank0_only=False)
    ref_sd = {k: _full(v).detach() for k, v in ref.state_dict().items()}
    assert set(full) == set(ref_sd), f"state dict keys differ: {set(full) ^ set(ref_sd)}"
    errs = {k: rel_err(full[k], ref_sd[k]) for k in ref_sd}
    worst = max(errs, key=errs.get)
    for name, ours, theirs in (("local", local_losses, ref_local_losses), ("global", losses, ref_losses)):
        loss_errs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
        assert not loss_errs or max(loss_errs) <= tol["loss"], (
            f"{name} losses {ours} vs reference {theirs} (rel err {max(loss_errs):.2e} > {tol['loss']})")
    moved = {k: rel_err(ref_sd[k], init_sd[k]) for k in ref_sd}
    if "param_of_update" in tol:
        # Each parameter's error is a small part of how far it moved.
        frac = {k: errs[k] / moved[k] for k in ref_sd if moved[k] > 0}
        k = max(frac, key=frac.get)
        assert frac[k] <= tol["param_of_update"], (
            f"parameter '{k}' error {errs[k]:.2e} is {frac[k]:.2f} of its update {moved[k]:.2e}")
    else:
        assert errs[worst] <= tol["param"], f"parameter '{worst}' rel err {errs[worst]:.3e} > {tol['param']}"
        assert max(moved.values()) > 100 * tol["param"], (
            f"reference parameters barely moved ({max(moved.values()):.2e}); the parity check would be vacuous")
    if clip:
        norm_errs = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
        assert max(norm_errs) <= tol["norm"], f"grad norms {norms} vs {ref_norms}"
        assert min(ref_norms) > clip, f"grad norms {ref_norms} never exceed {clip}: clipping was not exercised"
    if opts.get("tie"):
        assert full["head.weight"].equal(full["embed.weight"]), "tied weights diverged"
    # A fresh plain module loads the full state dict.
    plain = (_ReusedBlock if opts.get("reuse_block") else LlamaModel)(cfg)
    if opts.get("unused"):
        plain.blocks[0].unused = nn.Linear(cfg.d_model, 7)
    plain.load_state_dict(full)
    return {"local_losses": local_losses, "ref_local_losses": ref_local_losses, "losses": losses,
            "grad_errs": grad_errs, "max_param_err": errs[worst], "worst": worst}


def check_parity_results(results: List[Dict], steps: int) -> None:
    """For the test process: train_parity checked each rank's local losses and full
    gradients against the reference at every step; that it did so for every run and
    step, and that ranks trained on different rows (identical rows on every rank would
    let an unreduced gradient pass)."""
    runs = [[r] + r.get("extra_runs", []) for r in results]
    for per_rank in zip(*runs):
        for r in per_rank:
            assert len(r["grad_errs"]) == steps and len(r["local_losses"]) == steps, (
                f"{len(r['grad_errs'])} gradient and {len(r['local_losses'])} loss checks for {steps} steps")
        if len(per_rank) > 1:
            assert per_rank[0]["local_losses"] != per_rank[1]["local_losses"], "ranks 0 and 1 trained on the same rows"

class TinyOddModel(nn.Module):
    """Parameters smaller than the world size, of zero size, and of odd sizes."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 3)
        self.scalar = nn.Parameter(torch.tensor([0.7]))  # numel 1 < world
        self.empty = nn.Parameter(torch.empty(0, 3))     # zero-size
        self.odd = nn.Linear(3, 1, bias=False)           # numel 3

    def forward(self, x):
        h = torch.tanh(self.inner(x)) * self.scalar
        h = h + self.empty.sum()  # keeps the zero-size parameter in the graph
        return self.odd(h).squeeze(-1)


def train_tiny_parity(rank: int, world: int, opts: Dict) -> float:
    """Odd-sized, zero-size and smaller-than-world parameters train exactly like the reference."""
    device = device_for_backend()
    torch.manual_seed(0)
    model = TinyOddModel().to(device)
    ref = copy.deepcopy(model)
    mfsdp.fully_shard(model.inner)
    mfsdp.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    per_rank = 3
    for _ in range(5):
        x = torch.randn(per_rank * world, 5, generator=g).to(device)
        y = torch.randn(per_rank * world, generator=g).to(device)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()
    full = mfsdp.full_state_dict(model, rank0_only=False)
    worst = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert worst <= 1e-6, f"tiny model parity error {worst}"
    assert full["empty"].shape == (0, 3)
    return worst


def api_semantics(rank: int, world: int) -> None:
    """unshard/reshard, parameter registration, state dict round trips, replaced params."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 2}, device)
    shard(model, {})
    block = model.blocks[0]
    # Outside forward: sharded parameters, 1-D pieces that report the parameter's shape and
    # together hold each parameter once.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.detach().dim() == 1, "sharded parameters must be 1-D pieces"
        assert p.shape == q.shape and p.numel() == q.numel(), (name, p.shape, q.shape)
    local = sum(p.detach().numel() for p in model.parameters())
    total = torch.tensor([local], device=device)
    dist.all_reduce(total)
    assert total.item() == sum(p.numel() for p in ref.parameters())

    # unshard(): full parameters registered with the right values; reshard() undoes it.
    assert isinstance(block, mfsdp.FSDPModule)
    block.unshard()
    for (name, p), (_, q) in zip(block.named_parameters(), ref.blocks[0].named_parameters()):
        assert p.shape == q.shape, f"{name}: {p.shape} vs {q.shape}"
        assert torch.equal(p.detach(), q.detach()), f"{name} differs after unshard"
    block.reshard()
    assert all(p.detach().dim() == 1 for p in block.parameters())
    handle = block.unshard(async_op=True)
    handle.wait()
    assert block.mlp.w_down.weight.shape == ref.blocks[0].mlp.w_down.weight.shape
    block.reshard()

    # Full state dict loads into the plain module and round-trips through load_full_state_dict.
    full = mfsdp.full_state_dict(model, rank0_only=True)
    if rank == 0:
        plain = LlamaModel(cfg)
        plain.load_state_dict(full)
        for k, v in ref.state_dict().items():
            assert torch.equal(full[k], v.cpu()), k
    else:
        assert full == {}
    torch.manual_seed(77)
    other = LlamaModel(cfg).to(device)
    mfsdp.load_full_state_dict(model, other.state_dict())
    again = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in other.state_dict().items():
        assert torch.equal(again[k].to(device), v), f"load_full_state_dict lost {k}"
    bad = dict(other.state_dict())
    bad.pop("norm.weight")
    expect_error(lambda: mfsdp.load_full_state_dict(model, bad), KeyError, "norm.weight")

    # Replacing a parameter with a same-shaped one: adopted at the next unshard.
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    shape = tuple(ref.blocks[1].mlp.w_down.weight.shape)
    model.blocks[1].mlp.w_down.weight = nn.Parameter(torch.full(shape, 0.5, device=device))
    other.blocks[1].mlp.w_down.weight = nn.Parameter(torch.full(shape, 0.5, device=device))
    with torch.no_grad():
        out = model(tokens)
        expected = other(tokens)
    assert rel_err(out, expected) < 1e-6, "the forward after a replacement used the old values"
    replaced = mfsdp.full_state_dict(model, rank0_only=False)["blocks.1.mlp.w_down.weight"]
    assert torch.all(replaced == 0.5), "same-shape replacement was not adopted"
    # ...and with a different shape: a clear error naming the parameter.
    model.blocks[1].mlp.w_down.weight = nn.Parameter(torch.zeros(3, 3, device=device))
    try:
        with torch.no_grad():
            model(tokens)
        raise AssertionError("replacement with a different shape was accepted")
    except ValueError as e:
        assert "mlp.w_down.weight" in str(e) and "shape" in str(e), str(e)


def world_one_and_eval(rank: int, world: int) -> None:
    """Eval (no_grad) forward reshards everything; outputs match the reference."""
    device = device_for_backend()
    cfg, model, ref = build_models({}, device)
    shard(model, {})
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    with torch.no_grad():
        out = model(tokens)
        expected = ref(tokens)
    assert rel_err(out, expected) < 1e-6
    for m in model.modules():
        state = m.__dict__.get("_mfsdp_state")
        if state is not None and state.unit is not None:
            assert state.unit.unsharded_storage_bytes == 0, f"{state} still unsharded after eval forward"


def mismatched_group_errors(rank: int, world: int) -> None:
    """An all-gather or reduce-scatter group over other ranks than the sharding group is
    refused with both rank lists in the message."""
    device = device_for_backend()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: all ranks create both
    mine = halves[rank // 2]
    for what in ("all_gather_group", "reduce_scatter_group"):
        expect_error(lambda: mfsdp.fully_shard(nn.Linear(4, 4).to(device), **{what: mine}),
                     ValueError, what, "[0, 1, 2, 3]", "same ranks")


# ---------------------------------------------------------------- prefetch / overlap engine

class _Reversed(LlamaModel):
    """Runs its blocks in the reverse of construction order."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(self.norm(x))


def prefetch_semantics(rank: int, world: int, depth: int) -> Dict:
    """Runtime-order recording, prefetch targets, explicit overrides, the bound on
    simultaneously unsharded units, and one shared context per root."""
    device = device_for_backend()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=5, n_heads=4, ffn_hidden=64)
    model = _Reversed(cfg).to(device)
    ref = copy.deepcopy(model)
    for b in model.blocks:
        mfsdp.fully_shard(b, prefetch_depth=depth)
    # Per-unit prefetch is what this checks (buckets: test_buckets.py).
    mfsdp.fully_shard(model, prefetch_depth=depth, gather_bucket_bytes=0, reduce_bucket_bytes=0)
    root = model._fsdp_state
    blocks = [b._fsdp_state for b in model.blocks]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    max_live = {"fwd": 0, "bwd": 0}
    for step, (tokens, targets) in enumerate(global_batches(cfg, 3, 2 * world, 8, device)):
        # Step 0 records the order (and names the units); later steps are traced.
        with (UnitTrace([root] + blocks) if step else contextlib.nullcontext()) as trace:
            with UnitTrace.phase("fwd"):
                loss = model.loss(tokens[rank * 2:(rank + 1) * 2], targets[rank * 2:(rank + 1) * 2])
            with UnitTrace.phase("bwd"):
                loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        ref.loss(tokens, targets).backward()
        ref_opt.step()
        if step == 0:
            # Order recorded at runtime: root first, then blocks in reverse construction order.
            assert root.ctx.schedule.forward_order == [root] + blocks[::-1], "forward order not recorded at runtime"
            continue
        # How many non-root units were gathered at once, per phase.
        for ph, n in trace.max_unsharded(exclude={root}).items():
            if ph in max_live:
                max_live[ph] = max(max_live[ph], n)
        assert trace.unshards("fwd") == [root] + blocks[::-1], "forward all-gathers out of runtime order"
    assert max_live["fwd"] <= 1 + depth, f"forward had {max_live['fwd']} units unsharded (bound {1 + depth})"
    assert max_live["bwd"] <= 2 + depth, f"backward had {max_live['bwd']} units unsharded (bound {2 + depth})"
    if depth > 0:
        assert max_live["fwd"] == 1 + depth, f"prefetch depth {depth} never had {1 + depth} units in flight"
    full = mfsdp.full_state_dict(model, rank0_only=False)
    worst = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert worst <= 1e-5, f"parity with prefetch depth {depth}: {worst}"

    # Explicit override: the root prefetches nothing, block 4 (runs first) prefetches
    # block 0 (runs last).
    model.set_modules_to_forward_prefetch([])
    model.blocks[4].set_modules_to_forward_prefetch([model.blocks[0]])
    model.blocks[0].set_modules_to_backward_prefetch([])
    with UnitTrace([root] + blocks) as trace, torch.no_grad():
        model(tokens[:1])
    assert trace.unshards()[:3] == [root, blocks[4], blocks[0]], "explicit forward prefetch not honoured"

    # Context sharing: every unit under this root shares one context; a second root has its own.
    assert all(b.ctx is root.ctx for b in blocks) and root.ctx.root is root
    other = LlamaModel(cfg).to(device)
    mfsdp.fully_shard(other)
    with torch.no_grad():
        other(tokens[:1])
    assert other._fsdp_state.ctx is not root.ctx and other._fsdp_state.ctx.comm is not root.ctx.comm
    return max_live


def param_sync_modes(rank: int, world: int, on: bool) -> None:
    """all_gather_in_start_param_sync: on, the first units are gathered right after
    optimizer.step() (and training is unchanged); off, nothing is gathered outside
    forward/backward."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 3}, device)
    for b in model.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(model, all_gather_in_start_param_sync=on)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mfsdp.attach_param_sync(opt, model)
    states = [model._fsdp_state] + [b._fsdp_state for b in model.blocks]
    per = 2
    for step, (tokens, targets) in enumerate(global_batches(cfg, 4, per * world, 8, device)):
        step_with_reference(model, opt, ref, ref_opt, tokens, targets, slice(rank * per, (rank + 1) * per))
        gathered = [s for s in states if s.unit.state != s.unit.state.SHARDED]
        with torch.no_grad():  # a write after the early gather (EMA, second optimizer, ...)
            for p in list(model.parameters()) + list(ref.parameters()):
                p.mul_(0.999)
        assert all(s.slots_hold is SlotsHold.SHARDED for s in states), "start_param_sync must not install params"
        if on:  # the order is known once the first backward is done
            # Root plus prefetch_depth (1) next units in the recorded order.
            assert gathered == states[:2], f"expected root and first block gathered, got {[str(s) for s in gathered]}"
        else:
            assert gathered == [], f"gathered outside forward: {[str(s) for s in gathered]}"
    full = mfsdp.full_state_dict(model, rank0_only=False)  # fine with gathers in flight
    worst = max(rel_err(full[k], v) for k, v in ref.state_dict().items())
    assert worst <= 1e-5, f"parity with start_param_sync={on}: {worst}"
    # Loading a state dict drops early gathers: the next forward sees the new values.
    torch.manual_seed(3)
    fresh = LlamaModel(cfg).to(device)
    mfsdp.load_full_state_dict(model, fresh.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    with torch.no_grad():
        assert rel_err(model(tokens), fresh(tokens)) < 1e-6, "stale all-gather survived load_full_state_dict"


def _bf16_sharded_llama(cfg: LlamaConfig, device, depth: int = 1, buckets=0) -> LlamaModel:
    """A seeded LlamaModel with every block and the root sharded in bf16 (fp32 reduce);
    `buckets`: the root's gather and reduce bucket budgets (0: per unit, whose memory
    bound these tests count)."""
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        mfsdp.fully_shard(b, mp_policy=mp, prefetch_depth=depth)
    mfsdp.fully_shard(model, mp_policy=mp, prefetch_depth=depth, gather_bucket_bytes=buckets,
                      reduce_bucket_bytes=buckets)
    return model


def unsharded_memory_bound(rank: int, world: int, n_layers: int, depth: int) -> Dict:
    """The unsharded bytes held at once never exceed root + (2 + depth) blocks, for any
    number of blocks: memory held for parameters does not grow with depth."""
    device = device_for_backend()
    cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=n_layers, n_heads=4, ffn_hidden=352)
    model = _bf16_sharded_llama(cfg, device, depth)
    states = [model._fsdp_state] + [b._fsdp_state for b in model.blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = [0]
    for step, (tokens, targets) in enumerate(global_batches(cfg, 3, 2, 32, device)):
        # From step 1 the order is recorded: measure the steady state.
        with (UnitTrace(states) if step else contextlib.nullcontext()) as trace:
            model.loss(tokens, targets).backward()
            opt.step()
            opt.zero_grad()
        if step:
            held = trace.max_unsharded(weight=lambda s: s.unit.unsharded_nbytes)
            peak[0] = max([peak[0], *held.values()])
    root_bytes = model._fsdp_state.unit.layout.total_numel * 2
    block_bytes = model.blocks[0]._fsdp_state.unit.layout.total_numel * 2
    bound = root_bytes + (2 + depth) * block_bytes
    assert peak[0] <= bound, f"{peak[0]} unsharded bytes held at once > bound {bound} ({n_layers} layers, depth {depth})"
    return {"peak_unsharded_bytes": peak[0], "bound": bound}


# ---------------------------------------------------------------- uneven collectives

def uneven_collectives(rank: int, world: int, algos) -> int:
    """all_gather_v / reduce_scatter_v against a torch reference for random uneven
    segment sizes (some empty), on every algorithm given."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()
    group = dist.distributed_c10d._get_default_group()
    comm = _C.Communicator(group)
    # GROUPED needs uneven collective lists (NCCL); elsewhere it must be refused by name.
    caps = _C.backend_caps(group, device)
    checked = 0
    for trial in range(6):
        g = torch.Generator().manual_seed(100 + trial)
        numels = [int(x) for x in torch.randint(0, 40, (world,), generator=g)]
        if trial == 0:
            numels[world - 1] = 0
        if trial == 1:
            numels = [0] * world
        starts, cursor = [], 0
        for n in numels:
            starts.append(cursor)
            cursor += n
        total = cursor
        # Everyone can compute every rank's data: the reference needs no communication.
        data = [torch.randn(numels[r], generator=torch.Generator().manual_seed(1000 * trial + r)) for r in range(world)]
        grads = [torch.randn(total, generator=torch.Generator().manual_seed(7000 * trial + r)) for r in range(world)]
        expected_full = torch.cat(data) if total else torch.zeros(0)
        expected_rs = sum(grads)[starts[rank]:starts[rank] + numels[rank]]
        for algo in algos:
            if algo == "GROUPED" and not caps.uneven_lists:
                out = torch.zeros(total, device=device)
                for call in (lambda: comm.all_gather_v(out, data[rank].to(device), starts, numels, _C.VarAlgo.GROUPED),
                             lambda: comm.reduce_scatter_v(out[:numels[rank]], grads[rank].to(device), starts, numels,
                                                           _C.VarAlgo.GROUPED)):
                    expect_error(call, ValueError, "GROUPED uneven algorithm needs", f"backend '{caps.name}'")
                checked += 1
                continue
            if algo != "ALL_REDUCE":  # a reduce_scatter_v-only fallback
                out = torch.full((total,), float("nan"), device=device)  # poison: every element must be written
                comm.all_gather_v(out, data[rank].to(device), starts, numels, getattr(_C.VarAlgo, algo))
                assert torch.equal(out.cpu(), expected_full), f"all_gather_v {algo} numels {numels}"
            rs_out = torch.full((numels[rank],), float("nan"), device=device)
            comm.reduce_scatter_v(rs_out, grads[rank].to(device), starts, numels, getattr(_C.VarAlgo, algo))
            torch.testing.assert_close(rs_out.cpu(), expected_rs, rtol=1e-6, atol=1e-6)
            checked += 1
    return checked


def large_all_gather_v_auto(rank: int, world: int) -> str:
    """An all_gather_v large and balanced enough for AUTO to pick PADDED (the path a
    small test never takes): int32 ramps, so every misplaced element shows."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()
    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    per_rank = _C.PADDED_ALL_GATHER_MIN_BYTES // 4 // world
    numels = [per_rank + 1000 * r for r in range(world)]  # uneven, padding well under a third
    starts = [sum(numels[:r]) for r in range(world)]
    total = sum(numels)
    group = dist.distributed_c10d._get_default_group()
    chosen = _C.auto_var_algo(True, _C.backend_caps(group, device).uneven_lists, total, max(numels), world, 4)
    mine = torch.arange(starts[rank], starts[rank] + numels[rank], dtype=torch.int32, device=device)
    out = torch.full((total,), -1, dtype=torch.int32, device=device)
    comm.all_gather_v(out, mine, starts, numels, _C.VarAlgo.AUTO)
    assert torch.equal(out, torch.arange(total, dtype=torch.int32, device=device)), "all_gather_v AUTO"
    return chosen.name


# ---------------------------------------------------------------- layer-wise optimizer

def muon_and_adamw(params, lr_scale: float = 1.0):
    """Muon for 2-D hidden weights, AdamW for everything else (embeddings, head, norms)."""
    params = list(params)
    muon = [p for p in params if p.dim() == 2 and not getattr(p, "_is_embedding_like", False)]
    rest = [p for p in params if not (p.dim() == 2 and not getattr(p, "_is_embedding_like", False))]
    opts = []
    if muon:
        opts.append(torch.optim.Muon(muon, lr=0.02 * lr_scale, weight_decay=0.01))
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=1e-4 * lr_scale, weight_decay=0.1))
    return opts


def _layerwise_model(device, opts):
    torch.manual_seed(4321)
    cfg = LlamaConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, ffn_hidden=64, tie_embeddings=opts.get("tie", False))
    model = LlamaModel(cfg).to(device)
    for p in (model.embed.weight, model.head.weight):
        p._is_embedding_like = True
    ref = copy.deepcopy(model)
    for p in (ref.embed.weight, ref.head.weight):
        p._is_embedding_like = True
    return cfg, model, ref


def layerwise_parity(rank: int, world: int, opts: Dict) -> Dict:
    """Layer-wise Muon+AdamW across ranks == single-process Muon+AdamW on the full batch."""
    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer, newton_schulz_cost

    device = device_for_backend()
    cfg, model, ref = _layerwise_model(device, opts)
    factory = muon_and_adamw if opts.get("factory", "muon") == "muon" else (
        lambda ps: [torch.optim.SGD(list(ps), lr=0.05, momentum=0.9)] if list(ps) else None)
    lopt = LayerwiseDistributedOptimizer(
        model, factory, bucket_size=opts.get("bucket_size", 3000),
        overlap_param_gather=opts.get("overlap", True), cost_fn=newton_schulz_cost,
        grad_reduce=opts.get("grad_reduce", "reduce_scatter"))
    ref_opts = factory(list(ref.parameters()))
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    assert len(lopt.buckets) > 1, "test needs several buckets"
    compiled = {"graphs": {}, "calls": {}, "current": "model"}
    if opts.get("compile"):  # the model compiled after the optimizer installed its gather hooks
        from .observe import counting_aot_eager

        torch._dynamo.reset()
        model.compile(backend=counting_aot_eager(compiled))
    micro = opts.get("micro_batches", 1)
    per = 2
    for tokens, targets in global_batches(cfg, opts.get("steps", 5), per * world * micro, 16, device):
        for o in ref_opts:
            o.zero_grad()
        lopt.zero_grad()
        for m in range(micro):
            block = tokens[m * per * world:(m + 1) * per * world], targets[m * per * world:(m + 1) * per * world]
            # The reference's full-batch loss, written as the mean of the per-rank slices'
            # mean losses (the same number): its gradient then sums the same per-slice
            # terms the ranks reduce. Muon's orthogonalisation amplifies any difference
            # in rounding order, so this keeps the comparison about the optimizer logic.
            ref_loss = sum(ref.loss(block[0][r * per:(r + 1) * per], block[1][r * per:(r + 1) * per])
                           for r in range(world)) / world
            (ref_loss / micro).backward()
            rows = slice(rank * per, (rank + 1) * per)
            (model.loss(block[0][rows], block[1][rows]) / micro).backward()
        for o in ref_opts:
            o.step()
        lopt.step()
    lopt.finish_all()
    errs = {n: rel_err(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    worst = max(errs, key=errs.get)
    moved = {n: rel_err(q, init[n]) for n, q in ref.named_parameters()}
    if "tol_of_update" in opts:
        # Muon orthogonalises in bf16: a gradient differing in the last bit (another
        # reduction order) can round differently and is amplified; require each
        # parameter's error to be a small part of how far it moved.
        frac = {n: errs[n] / moved[n] for n in errs if moved[n] > 0}
        k = max(frac, key=frac.get)
        assert frac[k] <= opts["tol_of_update"], f"'{k}' error {errs[k]:.2e} is {frac[k]:.2f} of its update"
    else:
        assert errs[worst] <= opts.get("tol", 1e-6), f"'{worst}' rel err {errs[worst]:.3e}"
    owners = {n: b.layout.owner(i) for b in lopt.buckets for i, n in enumerate(b.names)}
    return {"worst": errs[worst], "owners": owners, "buckets": len(lopt.buckets),
            "compiled_calls": compiled["calls"].get("model", 0),
            "max_frac_of_update": max(errs[n] / moved[n] for n in errs if moved[n] > 0)}


def layerwise_partly_used(rank: int, world: int) -> Dict:
    """A parameter used on one rank only (a rank-dependent branch) whose owner is another
    rank: it trains as in one process over the whole batch, where it gets the gradient
    of that rank's slice. A parameter used nowhere keeps no gradient, on every rank."""
    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer

    device = device_for_backend()
    torch.manual_seed(7)
    model = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "never": nn.Linear(8, 8)}).to(device)
    ref = copy.deepcopy(model)
    sgd = lambda ps: [torch.optim.SGD(list(ps), lr=0.1, momentum=0.9)] if list(ps) else None
    lopt = LayerwiseDistributedOptimizer(model, sgd, bucket_size=80, overlap_param_gather=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    bucket, index = lopt._owner_of[id(model["b"].weight)]
    b_owner = bucket.layout.owner(index)
    user = (b_owner + 1) % world  # the one rank whose slice takes the branch

    def loss(m, x, use_b):
        y = m["a"](x)
        if use_b:
            y = y + m["b"](x).sin()
        return y.pow(2).mean()

    for step in range(3):
        x = torch.randn(world, 4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        ref_opt.zero_grad()
        lopt.zero_grad()
        (sum(loss(ref, x[r], r == user) for r in range(world)) / world).backward()
        loss(model, x[rank], rank == user).backward()
        ref_opt.step()
        lopt.step()
        lopt.finish_all()
        for name, p in model.named_parameters():
            if name.startswith("never"):
                assert p.grad is None, f"step {step}: '{name}' is used on no rank but has a gradient"
        errs = {n: rel_err(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-6, f"step {step}: '{worst}' rel err {errs[worst]:.3e} (b owned by rank {b_owner}, " \
                                    f"used on rank {user})"
    return {"b_owner": b_owner, "user": user}


def sgd_and_adamw(params):
    params = list(params)
    two_d = [p for p in params if p.dim() == 2]
    rest = [p for p in params if p.dim() != 2]
    out = []
    if two_d:
        out.append(torch.optim.SGD(two_d, lr=0.05, momentum=0.9))
    if rest:
        out.append(torch.optim.AdamW(rest, lr=1e-4, weight_decay=0.1))
    return out


def layerwise_checkpoint(rank: int, world: int, mode: str, path: str, save_world: int = 2) -> float:
    """Optimizer state saved by name at one world size resumes at another: training
    continued from the checkpoint matches uninterrupted single-process training."""
    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer

    device = device_for_backend()
    cfg, model, ref = _layerwise_model(device, {})
    rows_total, save_at, steps = 8, 3, 5
    batches = list(global_batches(cfg, steps, rows_total, 16, device))

    def train(m, opt, tokens, targets, w, r):
        per = rows_total // w
        opt.zero_grad()
        m.loss(tokens[r * per:(r + 1) * per], targets[r * per:(r + 1) * per]).backward()
        opt.step()

    if mode == "save":
        lopt = LayerwiseDistributedOptimizer(model, sgd_and_adamw, bucket_size=3000)
        for tokens, targets in batches[:save_at]:
            train(model, lopt, tokens, targets, world, rank)
        lopt.finish_all()
        state = lopt.state_dict()  # collective
        if rank == 0:
            torch.save({"model": {k: v.cpu() for k, v in model.state_dict().items()}, "opt": state}, path)
        return 0.0
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    lopt = LayerwiseDistributedOptimizer(model, sgd_and_adamw, bucket_size=3000)
    lopt.load_state_dict(ckpt["opt"])
    for tokens, targets in batches[save_at:]:
        train(model, lopt, tokens, targets, world, rank)
    lopt.finish_all()
    # Reference: the same global batches, uninterrupted, the mean of the slices' losses
    # in the order each phase's ranks would sum them.
    ref_opts = sgd_and_adamw(ref.parameters())
    for k, (tokens, targets) in enumerate(batches):
        w = save_world if k < save_at else world
        per = rows_total // w
        for o in ref_opts:
            o.zero_grad()
        (sum(ref.loss(tokens[r * per:(r + 1) * per], targets[r * per:(r + 1) * per]) for r in range(w)) / w).backward()
        for o in ref_opts:
            o.step()
    worst = max(rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert worst <= 1e-5, f"resumed at world {world} from a world-{save_world} checkpoint: rel err {worst:.2e}"
    # Bad checkpoints name the key.
    names = dict(zip(map(id, model.parameters()), (n for n, _ in model.named_parameters())))
    mine = [names[id(p)] for p in lopt.owned_params]
    if mine:  # drop a parameter this rank owns
        bad = {"state": {k: v for k, v in ckpt["opt"]["state"].items() if k != mine[0]}}
        expect_error(lambda: lopt.load_state_dict(bad), KeyError, f"missing parameter '{mine[0]}'")
    extra = {"state": dict(ckpt["opt"]["state"], **{"nope.weight": {}})}
    expect_error(lambda: lopt.load_state_dict(extra), KeyError, "nope.weight")
    return worst


def layerwise_gather_overlap(rank: int, world: int) -> Dict:
    """After step(), bucket k's all-gather-v (NCCL broadcasts or all-gather) runs while
    the forward of earlier layers computes: at least one gather kernel overlaps a
    compute kernel on another stream."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer

    from megatron_fsdp_ext.trace import kernel_intervals, overlapping

    device = device_for_backend()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, d_model=1024, n_layers=6, n_heads=16, ffn_hidden=2816)
    model = LlamaModel(cfg).to(device)
    lopt = LayerwiseDistributedOptimizer(model, sgd_and_adamw, bucket_size=8_000_000)
    batches = list(global_batches(cfg, 3, 4, 1024, device))
    for tokens, targets in batches[:2]:
        lopt.zero_grad()
        model.loss(tokens, targets).backward()
        lopt.step()
    lopt.zero_grad()
    model.loss(*batches[2]).backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lopt.step()  # launches the gathers and returns
        model.loss(*batches[2])  # forward pre-hooks finish each bucket just in time
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as trace_dir:
        path = f"{trace_dir}/layerwise_rank{rank}.json"
        prof.export_chrome_trace(path)
        kernels = kernel_intervals(path)
    gathers = [k for k in kernels if "nccl" in k[0].lower() and ("broadcast" in k[0].lower() or "allgather" in k[0].lower())]
    compute = [k for k in kernels if "nccl" not in k[0].lower()]
    n_overlapping = sum(overlapping(k, compute) for k in gathers)
    assert len(lopt.buckets) >= 3, f"expected several buckets, got {len(lopt.buckets)}"
    assert n_overlapping >= 1, f"no all-gather-v kernel overlapped compute ({len(gathers)} gathers)"
    return {"gathers": len(gathers), "overlapping": n_overlapping, "buckets": len(lopt.buckets)}


def bucketed_collective_counts(rank: int, world: int, buckets: Dict, via_setter: bool = False,
                               link_model: Optional[Tuple[float, float]] = None,
                               given_link: Optional[Tuple[float, float]] = None) -> Dict:
    """Collectives per training step (after the first, which records the order) with
    `buckets` (fully_shard's gather_bucket_bytes / reduce_bucket_bytes, 0 where
    missing; "auto" as fully_shard's default), the units gathered in each phase and the sharded parameters that got a
    gradient. Every unit is still gathered once in forward and once in backward (the
    root only in forward: it stays unsharded). link_model: (alpha seconds, bytes/s) the
    link measurement returns instead of timing the link; the budgets chosen and the
    link are returned too. given_link: (alpha seconds, bytes/s) handed to the root's
    set_link_model (the public way), and the link measurement made to fail if it runs."""
    from unittest import mock

    from megatron_fsdp_ext import link
    from .observe import count_collectives
    if link_model is not None:
        mock.patch.object(link, "measure_link", lambda group, device: link.LinkModel(*link_model)).start()
    device = device_for_backend()
    cfg, model, _ = build_models({}, device)
    shard(model, {} if via_setter else buckets)
    if given_link is not None:
        def no_probe(group, device):
            raise AssertionError("the link was timed although set_link_model gave one")
        mock.patch.object(link, "measure_link", no_probe).start()
        model.set_link_model(link.LinkModel(*given_link))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    states = [m._fsdp_state for m in model.modules() if "_mfsdp_state" in m.__dict__]
    batches = list(global_batches(cfg, 4, 2 * world, 8, device))
    rows = slice(rank * 2, rank * 2 + 2)
    with_grad = []

    def step(tokens, targets, trace=None):
        with trace.phase("fwd") if trace else contextlib.nullcontext():
            loss = model.loss(tokens[rows], targets[rows])
        with trace.phase("bwd") if trace else contextlib.nullcontext():
            loss.backward()
        with_grad.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()

    for tokens, targets in batches[:2]:
        step(tokens, targets)
    if via_setter:  # on the root after the order was recorded: the plan follows
        model.set_gather_bucket_bytes(buckets.get("gather_bucket_bytes", 0))
        model.set_reduce_bucket_bytes(buckets.get("reduce_bucket_bytes", 0))
    with count_collectives() as counts:  # one profiler at a time: counts, then the trace
        step(*batches[2])
    with UnitTrace(states) as trace:
        step(*batches[3], trace=trace)
    return {"all_gathers": counts.get("all_gather", 0), "reduce_scatters": counts.get("reduce_scatter", 0),
            "c10d_calls": {k: v for k, v in counts.items() if k.startswith("c10d::")},
            "units": len(states), "params": len(list(model.parameters())), "params_with_grad": with_grad[2:],
            "fwd_unshards": len(trace.unshards("fwd")), "bwd_unshards": len(trace.unshards("bwd")),
            "budgets": model.bucket_budgets(), "link": model._fsdp_state.ctx.link,
            "unit_bytes": sum(s.unit.unsharded_nbytes for s in states)}


def accumulated_reductions_in_buckets(rank: int, world: int) -> Dict:
    """Gradients accumulated without sync over two micro-batches, reduced (a) by a synced
    last backward or (b) after it by finish_grad_sync() (Megatron's spelling; torch's
    pipelining reduces the same way in its REDUCE_GRAD), with one reduce bucket for the
    four units: the reduce-scatters of each step both ways, and whether the reduced
    gradients (this rank's pieces) are the same bit for bit."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).to(device)
        for layer in model:
            mfsdp.fully_shard(layer, reduce_bucket_bytes=1 << 30, gather_bucket_bytes=0)
        return mfsdp.fully_shard(model, reduce_bucket_bytes=1 << 30, gather_bucket_bytes=0)

    out = {}
    for how in ("synced_last_backward", "finish_grad_sync"):
        model = build()
        gen = torch.Generator().manual_seed(rank)
        model(torch.randn(4, 16, generator=gen).to(device)).sum().backward()  # records the order
        model.zero_grad(set_to_none=True)
        counts = []
        for _ in range(2):
            _C.reset_collective_counts()
            model.set_requires_gradient_sync(False)
            model(torch.randn(4, 16, generator=gen).to(device)).sum().backward()
            model.set_requires_gradient_sync(how == "synced_last_backward")
            model(torch.randn(4, 16, generator=gen).to(device)).sum().backward()
            if how == "finish_grad_sync":
                model.set_requires_gradient_sync(True)
                model.finish_grad_sync()
            counts.append(_C.collective_counts()["reduce_scatter"][0])
        out[how] = {"reduce_scatters": counts, "grads": [p.grad.to_local().clone() for p in model.parameters()]}
    grads = [r.pop("grads") for r in out.values()]
    out["same_grads"] = len(grads[0]) == len(grads[1]) == 8 and all(torch.equal(a, b) for a, b in zip(*grads))
    return out


def originals_freed_at_once(rank: int, world: int, blocks: int = 3) -> Dict:
    """With the garbage collector off, fully_shard over every block and the root frees the
    original (unsharded) parameters the moment the units replace them: nothing of ours
    (a cycle through a recursive closure, a frame kept by an import's traceback) holds
    them until the collector happens to run. Names the cycle's frames when it fails."""
    import gc
    import sys
    import weakref

    device = device_for_backend()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, n_layers=blocks, n_heads=4, ffn_hidden=64))
    originals = [(name, weakref.ref(p)) for name, p in model.named_parameters()]
    dynamo_before = "torch._dynamo" in sys.modules
    gc.collect()
    gc.disable()
    try:
        shard_blocks_and_root(model)
        alive = [name for name, ref in originals if ref() is not None]
        frames = []
        if alive:
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            frames = sorted({f"{o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 1)[-1]})"
                             for o in gc.garbage if type(o).__name__ == "frame"})[:12]
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        gc.enable()
    assert not alive, (f"{len(alive)} of {len(originals)} original parameters outlive fully_shard until the garbage "
                       f"collector runs (first: {alive[:4]}); frames in the garbage: {frames}")
    return {"dynamo_imported_before": dynamo_before, "originals": len(originals)}
