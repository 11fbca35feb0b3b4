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


def expect_error(fn, exc_type, *fragments: str) -> None:
    """fn() must raise exc_type whose message contains every fragment."""
    try:
        fn()
    except exc_type as e:
        for f in fragments:
            assert f in str(e), f"{f!r} not in the error message: {e}"
        return
    raise AssertionError(f"no {exc_type.__name__} raised (expected one mentioning {fragments})")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are empty or zero)."""
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
        create_all_gather_group=opts.get("create_all_gather_group"),
    )
    for block in model.blocks:
        mfsdp.fully_shard(block, **kw)
    mfsdp.fully_shard(model, **kw)
    return model


def make_optimizer(params, opts: Dict):
    kind = opts.get("optimizer", "adamw")
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
    # bf16 compute vs an fp32 reference: losses within bf16 tolerance, and every
    # parameter's error a small fraction of how far it moved (lr 1e-3 so it moves).
    "bf16_mixed_precision": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32,
        "lr": 1e-3, "loss_tol": 1e-2, "param_tol_of_update": 0.15,
    },
    "bf16_reduce": {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16,
        "lr": 1e-3, "loss_tol": 1e-2, "param_tol_of_update": 0.15,
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


def train_parity(rank: int, world: int, opts: Dict) -> Dict:
    """Train sharded vs reference for opts['steps'] steps; assert parity; return stats."""
    device = device_for_backend()
    cfg, model, ref = build_models(opts, device)
    init_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
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
            # sync_every_micro: reduce every backward, accumulating into existing .grad.
            model.set_requires_gradient_sync(opts.get("sync_every_micro", False) or m == micro - 1)
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
    moved = {k: rel_err(ref_sd[k], init_sd[k]) for k in ref_sd}
    if "param_tol_of_update" in opts:
        # Low precision: each parameter must end far closer to the reference than the
        # reference is to the initial value (its error is a small part of its update).
        frac = {k: errs[k] / moved[k] for k in ref_sd if moved[k] > 0}
        k = max(frac, key=frac.get)
        assert frac[k] <= opts["param_tol_of_update"], (
            f"parameter '{k}' error {errs[k]:.2e} is {frac[k]:.2f} of its update {moved[k]:.2e}")
    else:
        assert errs[worst] <= param_tol, f"parameter '{worst}' rel err {errs[worst]:.3e} > {param_tol}"
        assert max(moved.values()) > 100 * param_tol, (
            f"reference parameters barely moved ({max(moved.values()):.2e}); the parity check would be vacuous")
    if clip:
        norm_errs = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
        assert max(norm_errs) <= opts.get("norm_tol", 1e-4), f"grad norms {norms} vs {ref_norms}"
    if opts.get("tie"):
        assert full["head.weight"].equal(full["embed.weight"]), "tied weights diverged"
    # A fresh plain module loads the full state dict.
    plain = (_ReusedBlock if opts.get("reuse_block") else LlamaModel)(cfg)
    if opts.get("unused"):
        plain.blocks[0].unused = nn.Linear(cfg.d_model, 7)
    plain.load_state_dict(full)
    return {"losses": losses, "ref_losses": ref_losses, "max_param_err": errs[worst], "worst": worst}


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
    # Outside forward: sharded 1-D parameters, which together hold each parameter once.
    for p in model.parameters():
        assert p.dim() == 1, "sharded parameters must be 1-D shards"
    local = sum(p.numel() for p in model.parameters())
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
    assert all(p.dim() == 1 for p in block.parameters())
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


# ---------------------------------------------------------------- GPU-only workers

def _sleep_cycles() -> int:
    return 20_000_000  # ~10 ms on an H200: long enough to expose a missing wait


def install_stream_chaos() -> None:
    """Delay the compute stream right before every unshard and gradient reduction,
    and the side streams right before their collectives are issued, so that any
    missing cross-stream wait produces wrong numbers instead of passing by luck."""
    from megatron_fsdp_ext import hooks

    def as_cuda_stream(s):
        return torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    orig_unshard = hooks.FSDPState.unshard
    orig_post_backward = hooks.FSDPState.post_backward

    def unshard(self):
        if self.unit is not None and self.ctx is not None:
            torch.cuda._sleep(_sleep_cycles())            # compute still busy when AG starts
            with torch.cuda.stream(as_cuda_stream(self.ctx.comm.all_gather_stream())):
                torch.cuda._sleep(_sleep_cycles())        # AG late: compute must wait for it
        orig_unshard(self)

    def post_backward(self):
        if self.unit is not None and not self._post_backward_done:
            torch.cuda._sleep(_sleep_cycles())            # grads packed late on compute
            with torch.cuda.stream(as_cuda_stream(self.ctx.comm.reduce_scatter_stream())):
                torch.cuda._sleep(_sleep_cycles())        # RS late: optimizer must wait
        orig_post_backward(self)

    hooks.FSDPState.unshard = unshard
    hooks.FSDPState.post_backward = post_backward


def train_parity_with_stream_chaos(rank: int, world: int, opts: Dict) -> Dict:
    install_stream_chaos()
    return train_parity(rank, world, opts)


def cuda_device_errors(rank: int, world: int) -> None:
    """Parameters not on the process group's device are refused with a clear message."""
    gloo = dist.new_group(backend="gloo")
    m = nn.Linear(4, 4).cuda()
    expect_error(lambda: mfsdp.fully_shard(m, process_group=gloo), ValueError, "backend 'gloo'", "cuda")
    m = nn.Linear(4, 4)  # CPU params, default NCCL group
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "move the module to cuda")
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    m = nn.Linear(4, 4).to(f"cuda:{other}")
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "current CUDA device")
    m = nn.Sequential(nn.Linear(4, 4).cuda(), nn.Linear(4, 4))
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "different devices")


def unsharded_memory_released(rank: int, world: int) -> Dict:
    """After a training step every unit is resharded, no side buffer is in flight,
    zero_grad(set_to_none=True) frees all gradient memory (the units keep no
    reference), and allocated memory does not grow from step to step."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 4, "d_model": 256, "ffn": 688, "vocab": 512}, device)
    shard(model, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    after, drops = [], []
    for tokens, targets in global_batches(cfg, 4, 4, 64, device):
        model.loss(tokens, targets).backward()
        opt.step()
        torch.cuda.synchronize()
        grad_storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                         for p in model.parameters() if p.grad is not None}
        before = torch.cuda.memory_allocated()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        drops.append((before - after[-1], sum(grad_storages.values())))
        for m in model.modules():
            st = m.__dict__.get("_mfsdp_state")
            if st is not None and st.unit is not None:
                assert st.unit.unsharded_storage_bytes == 0, f"{st} still holds unsharded storage"
                assert st.ctx.comm.num_inflight_reductions == 0
    for freed, grad_bytes in drops:
        assert freed >= grad_bytes, f"zero_grad freed {freed} bytes of {grad_bytes} gradient bytes: something keeps grads alive"
    # No growth once the optimizer state exists (from the second step on).
    assert max(after[1:]) <= after[1] + (256 << 10), f"allocated memory grows: {after}"
    return {"allocated_after_step": after, "freed_by_zero_grad": drops}


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
    from megatron_fsdp_ext import hooks

    device = device_for_backend()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=5, n_heads=4, ffn_hidden=64)
    model = _Reversed(cfg).to(device)
    ref = copy.deepcopy(model)
    for b in model.blocks:
        mfsdp.fully_shard(b, prefetch_depth=depth)
    mfsdp.fully_shard(model, prefetch_depth=depth)
    root = model._fsdp_state
    blocks = [b._fsdp_state for b in model.blocks]

    events = []  # (phase, kind, state) for every unshard issued / reshard done
    phase = ["fwd"]
    orig_unshard, orig_reshard = hooks.FSDPState.unshard, hooks.FSDPState.reshard

    def unshard(self):
        if self.unit is not None and self.unit.state == self.unit.state.SHARDED:
            events.append((phase[0], "unshard", self))
        orig_unshard(self)

    def reshard(self):
        if self.unit is not None and self.unit.state != self.unit.state.SHARDED:
            events.append((phase[0], "reshard", self))
        orig_reshard(self)

    hooks.FSDPState.unshard, hooks.FSDPState.reshard = unshard, reshard
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    max_live = {"fwd": 0, "bwd": 0}
    try:
        for step, (tokens, targets) in enumerate(global_batches(cfg, 3, 2 * world, 8, device)):
            events.clear()
            phase[0] = "fwd"
            loss = model.loss(tokens[rank * 2:(rank + 1) * 2], targets[rank * 2:(rank + 1) * 2])
            phase[0] = "bwd"
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            ref.loss(tokens, targets).backward()
            ref_opt.step()
            if step == 0:
                # Order recorded at runtime: root first, then blocks in reverse construction order.
                assert root.ctx.forward_order == [root] + blocks[::-1], "forward order not recorded at runtime"
                continue
            # Replay the events: how many non-root units were gathered at once, per phase.
            live = set()
            for ph, kind, st in events:
                if st is root:
                    continue
                (live.add if kind == "unshard" else live.discard)(st)
                max_live[ph] = max(max_live[ph], len(live))
            fwd_unshards = [st for ph, kind, st in events if ph == "fwd" and kind == "unshard"]
            assert fwd_unshards == [root] + blocks[::-1], "forward all-gathers out of runtime order"
    finally:
        hooks.FSDPState.unshard, hooks.FSDPState.reshard = orig_unshard, orig_reshard
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
    seen = []
    orig = hooks.FSDPState.unshard

    def spy(self):
        if self.unit is not None and self.unit.state == self.unit.state.SHARDED:
            seen.append(self)
        orig(self)

    hooks.FSDPState.unshard = spy
    try:
        with torch.no_grad():
            model(tokens[:1])
    finally:
        hooks.FSDPState.unshard = orig
    assert seen[:3] == [root, blocks[4], blocks[0]], "explicit forward prefetch not honoured"

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
        assert not any(s.unsharded_installed for s in states), "start_param_sync must not install params"
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


def _unsharded_bytes_probe(states):
    """Wrap every state's unshard/reshard to record the most unsharded bytes held at once."""
    from megatron_fsdp_ext import hooks

    peak = [0]
    orig_unshard, orig_reshard = hooks.FSDPState.unshard, hooks.FSDPState.reshard

    def sample():
        peak[0] = max(peak[0], sum(s.unit.unsharded_storage_bytes for s in states if s.unit is not None))

    def unshard(self):
        orig_unshard(self)
        sample()

    def reshard(self):
        sample()
        orig_reshard(self)

    hooks.FSDPState.unshard, hooks.FSDPState.reshard = unshard, reshard

    def restore():
        hooks.FSDPState.unshard, hooks.FSDPState.reshard = orig_unshard, orig_reshard

    return peak, restore


def _bf16_sharded_llama(cfg: LlamaConfig, device, depth: int = 1) -> LlamaModel:
    """A seeded LlamaModel with every block and the root sharded in bf16 (fp32 reduce)."""
    torch.manual_seed(0)
    model = LlamaModel(cfg).to(device)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        mfsdp.fully_shard(b, mp_policy=mp, prefetch_depth=depth)
    mfsdp.fully_shard(model, mp_policy=mp, prefetch_depth=depth)
    return model


def unsharded_memory_bound(rank: int, world: int, n_layers: int, depth: int) -> Dict:
    """The unsharded bytes held at once never exceed root + (2 + depth) blocks, for any
    number of blocks: memory held for parameters does not grow with depth."""
    device = device_for_backend()
    cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=n_layers, n_heads=4, ffn_hidden=352)
    model = _bf16_sharded_llama(cfg, device, depth)
    states = [model._fsdp_state] + [b._fsdp_state for b in model.blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step, (tokens, targets) in enumerate(global_batches(cfg, 3, 2, 32, device)):
        if step == 1:  # the order is recorded: measure the steady state
            peak, restore = _unsharded_bytes_probe(states)
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    restore()
    root_bytes = model._fsdp_state.unit.layout.total_numel * 2
    block_bytes = model.blocks[0]._fsdp_state.unit.layout.total_numel * 2
    bound = root_bytes + (2 + depth) * block_bytes
    assert peak[0] <= bound, f"{peak[0]} unsharded bytes held at once > bound {bound} ({n_layers} layers, depth {depth})"
    return {"peak_unsharded_bytes": peak[0], "bound": bound}


def overlap_profile(rank: int, world: int, n_layers: int, trace_dir: str = "") -> Dict:
    """torch.profiler on one steady-state step: forward all-gathers overlap compute
    kernels (>= N-1 of them), backward all-gathers and reduce-scatters overlap compute,
    and with separate communicators all-gather and reduce-scatter kernels overlap."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from .trace import kernel_intervals, overlapping

    device = device_for_backend()
    # Big enough that the GPU, not the CPU launching kernels, sets the pace (as in
    # real training): on a launch-bound step a prefetched all-gather finishes before
    # the next compute kernel is even issued, and nothing can overlap.
    cfg = LlamaConfig(vocab_size=8192, d_model=2048, n_layers=n_layers, n_heads=16, ffn_hidden=5504)
    model = _bf16_sharded_llama(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = list(global_batches(cfg, 3, 8, 2048, device))
    for tokens, targets in batches[:2]:
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    tokens, targets = batches[2]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # A long leading kernel puts the GPU behind the CPU, so the timeline shows what
        # the engine's stream dependencies allow, not how fast Python launches kernels.
        torch.cuda._sleep(10 * _sleep_cycles())
        loss = model.loss(tokens, targets)
        torch.cuda._sleep(1000)  # marker kernel between forward and backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    path = os.path.join(trace_dir or tempfile.mkdtemp(), f"overlap_trace_rank{rank}.json")
    prof.export_chrome_trace(path)
    kernels = kernel_intervals(path)
    if trace_dir and rank == 0:
        try:
            from .trace import plot_timeline
            plot_timeline(kernels, os.path.join(trace_dir, "overlap_timeline.png"),
                          f"fully_shard, {n_layers} blocks: one step (after a leading sleep), rank 0")
        except ImportError:
            pass
    spins = sorted((k for k in kernels if "spin" in k[0].lower()), key=lambda k: k[2])
    assert len(spins) == 2, f"expected the two marker kernels, found {len(spins)}"
    marker = spins[1][2]
    is_nccl = lambda k: "nccl" in k[0].lower()  # noqa: E731
    compute = [k for k in kernels if not is_nccl(k) and "spin" not in k[0].lower()]
    ag = [k for k in kernels if is_nccl(k) and "allgather" in k[0].lower()]
    rs = [k for k in kernels if is_nccl(k) and "reducescatter" in k[0].lower()]
    fwd_ag = [k for k in ag if k[3] <= marker]
    bwd_ag = [k for k in ag if k[2] >= marker]
    stats = {
        "fwd_all_gathers": len(fwd_ag),
        "fwd_all_gathers_overlapping_compute": sum(overlapping(k, compute) for k in fwd_ag),
        "bwd_all_gathers_overlapping_compute": sum(overlapping(k, compute) for k in bwd_ag),
        "reduce_scatters_overlapping_compute": sum(overlapping(k, compute) for k in rs),
        "all_gathers_overlapping_reduce_scatters": sum(overlapping(k, rs) for k in ag),
        # Per forward all-gather: (start ms after the first, duration ms, overlaps compute).
        "fwd_timeline": [(round((k[2] - fwd_ag[0][2]) / 1e3, 3), round((k[3] - k[2]) / 1e3, 3), overlapping(k, compute))
                         for k in fwd_ag],
        "trace": path,
    }
    assert stats["fwd_all_gathers_overlapping_compute"] >= n_layers - 1, stats
    assert stats["bwd_all_gathers_overlapping_compute"] >= 1, stats
    assert stats["reduce_scatters_overlapping_compute"] >= 1, stats
    assert stats["all_gathers_overlapping_reduce_scatters"] >= 1, stats
    return stats


def cuda_graph_training(rank: int, world: int, steps: int = 4) -> Dict:
    """With all_gather_in_start_param_sync off (the default) nothing is launched outside
    forward/backward, so a whole training step (forward, backward with its
    reduce-scatters, optimizer step) is captured once in a CUDA graph and replayed.
    The replayed model matches an identically sharded model trained eagerly."""
    device = device_for_backend()
    cfg, graphed, eager = build_models({"layers": 3, "d_model": 64, "ffn": 176}, device)
    for m in (graphed, eager):  # two independent roots, each with its own context
        shard(m, {})
    initial = [p.detach().clone() for p in eager.parameters()]
    # capturable: the step count lives on the GPU, so the captured step advances it.
    opt = torch.optim.AdamW(graphed.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
    per = 2
    batches = [(t[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
               for t, y in global_batches(cfg, 3 + steps, per * world, 16, device)]

    def train_step(model, optimizer, tokens, targets):
        loss = model.loss(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss

    # Warm-up on a side stream (lazy init, recorded forward order, NCCL and cuBLAS setup).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for tokens, targets in batches[:3]:
            for model, optimizer in ((graphed, opt), (eager, eager_opt)):
                optimizer.zero_grad(set_to_none=True)
                train_step(model, optimizer, tokens, targets)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    static_tokens, static_targets = batches[3][0].clone(), batches[3][1].clone()
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_loss = train_step(graphed, opt, static_tokens, static_targets)
    worst_loss = 0.0
    for tokens, targets in batches[3:]:
        static_tokens.copy_(tokens)
        static_targets.copy_(targets)
        graph.replay()
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = train_step(eager, eager_opt, tokens, targets)
        worst_loss = max(worst_loss, abs(static_loss.item() - eager_loss.item()))
    torch.cuda.synchronize()
    worst_param = max(rel_err(a.detach(), b.detach()) for a, b in zip(graphed.parameters(), eager.parameters()))
    moved = max(rel_err(p, p0) for p, p0 in zip(eager.parameters(), initial))
    # Same kernels in the same order; the margin only covers nondeterministic kernels.
    assert worst_loss <= 1e-4, f"replayed losses differ from eager: {worst_loss}"
    assert worst_param <= 1e-4, f"replayed parameters differ from eager: {worst_param}"
    assert moved > 1e-3, "training did not move the parameters: the comparison proves nothing"
    return {"worst_loss": worst_loss, "worst_param": worst_param}


# ---------------------------------------------------------------- uneven collectives

def uneven_collectives(rank: int, world: int, algos) -> int:
    """all_gather_v / reduce_scatter_v against a torch reference for random uneven
    segment sizes (some empty), on every algorithm given."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()
    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
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
    chosen = _C.auto_var_algo(True, device.type == "cuda", total, max(numels), world, 4)
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
            "max_frac_of_update": max(errs[n] / moved[n] for n in errs if moved[n] > 0)}


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

    from .trace import kernel_intervals, overlapping

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
    path = tempfile.mkdtemp() + f"/layerwise_rank{rank}.json"
    prof.export_chrome_trace(path)
    kernels = kernel_intervals(path)
    gathers = [k for k in kernels if "nccl" in k[0].lower() and ("broadcast" in k[0].lower() or "allgather" in k[0].lower())]
    compute = [k for k in kernels if "nccl" not in k[0].lower()]
    n_overlapping = sum(overlapping(k, compute) for k in gathers)
    assert len(lopt.buckets) >= 3, f"expected several buckets, got {len(lopt.buckets)}"
    assert n_overlapping >= 1, f"no all-gather-v kernel overlapped compute ({len(gathers)} gathers)"
    return {"gathers": len(gathers), "overlapping": n_overlapping, "buckets": len(lopt.buckets)}
