"""Workers of tests/distributed/test_same_result.py: scripts that FSDP2 and one plain
process train alike, where our units once gave silently different gradients (issue 41's
probe findings), each compared step by step with one plain process on the whole batch."""
import copy
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import owner_of

from .workers import device_for_backend

D = 16


def _full_grad(p):
    """The full gradient of one of our sharded parameters (a collective over its unit)."""
    state, i = owner_of(p)
    pieces = [None] * len(state.sharded_params)
    pieces[i] = p.grad if p.grad is not None else torch.zeros_like(p)
    return state.unit.gather_full(pieces, torch.float32)[i]


def _hsdp_mesh(world: int):
    """HSDP's 2-D mesh for these workers: 2 replicas of world / 2 shards."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_for_backend().type, (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _step_and_compare(model, plain, opt, ref_opt, step: int, worst: dict, unused_ok: bool = False) -> None:
    """Every parameter's full gradient against plain's (worst["grad"] keeps the largest
    relative error), then both optimizers step and zero. `unused_ok`: a parameter no rank
    used has no gradient in plain and must have none here; else plain must have one."""
    for (name, q), p in zip(plain.named_parameters(), model.parameters()):
        if q.grad is None:
            assert unused_ok, f"step {step}: plain has no gradient for {name}"
            assert p.grad is None, f"step {step}: {name}, used on no rank, got a gradient"
            continue
        err = ((_full_grad(p).to(q.grad.device) - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item()
        assert err < 1e-5, f"step {step}: gradient of {name} off by {err:.2e} (got None: {p.grad is None})"
        worst["grad"] = max(worst["grad"], err)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()


def train_against_plain(model_fn, shard_fn, loss_fn, steps: int = 4, lr: float = 0.05):
    """Trains model_fn() sharded by shard_fn and plain on the whole batch (the mean of the
    ranks' losses); returns the worst relative error of the gradients (every parameter,
    every step) and of the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for_backend()
    plain = model_fn().to(device)
    model = shard_fn(copy.deepcopy(plain))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=lr)
    worst = {"grad": 0.0, "loss": 0.0}
    for step in range(steps):
        batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step)).to(device)
        ref_loss = sum(loss_fn(plain, batch[r]) for r in range(world)) / world
        ref_loss.backward()
        loss = loss_fn(model, batch[rank])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(total.item() / world - ref_loss.item()) / abs(ref_loss.item()))
        _step_and_compare(model, plain, opt, ref_opt, step, worst)
    return worst


class SharedOnRawInput(nn.Module):
    """One Linear applied to the raw input (no gradient needed there) and again to the
    hidden state: the first call's backward runs after the second call's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)

    def forward(self, x):
        return self.shared(torch.tanh(self.mid(self.shared(x))))


class TiedEmbedding(nn.Module):
    """A tied embedding and head in one unit of several modules (fully_shard([embed, norm,
    head])): the lookup on token ids needs no input gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, D)
        self.body = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(torch.relu(self.body(self.embed(tokens)))))


@dataclass
class BlockOutput:
    hidden: torch.Tensor
    aux: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return BlockOutput(hidden=h, aux=h.pow(2).mean())


class DataclassModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(D, D)  # the block's input needs a gradient: its backward reads its weight
        self.block = DataclassBlock()
        self.head = nn.Linear(D, D)

    def forward(self, x):
        out = self.block(self.pre(x))
        return self.head(out.hidden).pow(2).mean() + out.aux


class NonContiguousParams(nn.Module):
    """Parameters whose strides are not the contiguous ones: channels-last convolution
    weights (model.to(memory_format=torch.channels_last)) and a Linear weight stored
    transposed. FSDP2 refuses both; ours packs them in logical order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(2, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 4, 3, padding=1, groups=2)
        self.to(memory_format=torch.channels_last)
        self.proj_weight = nn.Parameter(0.1 * torch.randn(D // 2 * 4, D).t())

    def forward(self, x):
        h = x.view(-1, 2, 4, D // 8).contiguous(memory_format=torch.channels_last)
        h = self.conv2(torch.relu(self.conv1(h)))
        return nn.functional.linear(h.flatten(1), self.proj_weight)


def non_contiguous_parameters(rank, world):
    # cuDNN convolutions default to TF32; the plain model's channels-last weight and the
    # gathered contiguous one may take different algorithms: compare in full fp32.
    torch.backends.cudnn.allow_tf32 = False

    def model_fn():
        m = NonContiguousParams()
        laid_out = {n: p.is_contiguous() for n, p in m.named_parameters() if p.dim() > 1}
        assert not any(laid_out.values()), f"the test's parameters are meant to be non-contiguous: {laid_out}"
        return m

    def shard(m):
        mfsdp.fully_shard(m.conv1)
        return mfsdp.fully_shard(m)
    return train_against_plain(model_fn, shard, lambda m, x: m(x).pow(2).mean())


def shared_on_raw_input(rank, world):
    def shard(m):
        mfsdp.fully_shard(m.shared)
        mfsdp.fully_shard(m.mid)
        return mfsdp.fully_shard(m)
    return train_against_plain(SharedOnRawInput, shard, lambda m, x: m(x).pow(2).mean())


def tied_embedding(rank, world, buckets: int):
    def shard(m):
        mfsdp.fully_shard(m.body)
        mfsdp.fully_shard([m.embed, m.norm, m.head])
        return mfsdp.fully_shard(m, reduce_bucket_bytes=buckets)

    def loss(m, x):
        tokens = (x.abs() * 7).long().clamp_max(31)[:, :3]
        return m(tokens).float().logsumexp(-1).mean()
    return train_against_plain(TiedEmbedding, shard, loss)


def dataclass_output(rank, world):
    def shard(m):  # no prefetch: the block's own pre-backward must gather it
        mfsdp.fully_shard(m.block)
        return mfsdp.fully_shard(m, prefetch_depth=0)
    return train_against_plain(DataclassModel, shard, lambda m, x: m(x))


# ---------------------------------------------------------------- writes through .data

def _post_step_write(step: int, name: str, p: torch.Tensor) -> None:
    """What scripts do to parameters between steps, all through `.data` (which moves no
    version counter): a clamp, a manual EMA, a reset."""
    if step == 0:
        p.data.clamp_(-0.08, 0.08)
    elif step == 1:
        p.data.mul_(0.9).add_(0.01)
    elif name.endswith("bias"):
        p.data.zero_()
    else:
        p.data.clamp_(-0.05, 0.05)


def _write_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D), nn.Tanh(), nn.Linear(D, D))


def data_writes_after_step(rank, world, strategy: str, param_dtype, offload: str):
    """Trains the same script under our fully_shard(strategy, param_dtype, offload) and
    under FSDP2 with the same mixed precision (no offload): after every optimizer step,
    each rank writes its parameters through `.data`. Returns the worst relative error of
    the losses, of the last step's full gradients and of the final parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from megatron_fsdp_ext.optim import CPUAdamW
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = device_for_backend()
    plain = _write_model()
    ref = copy.deepcopy(plain).to(device)
    # Offloaded units are sharded from the CPU (their shards stay there); others on the device.
    ours = copy.deepcopy(plain) if offload != "none" else copy.deepcopy(plain).to(device)
    reduce_dtype = torch.float32 if param_dtype is not None else None
    keeps = strategy != "optim_grads_params"
    kw = dict(sharding_strategy=strategy, reshard_after_forward=not keeps,
              mp_policy=mfsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if offload != "none":
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in (ours[0], ours[2], ours[4]):
        mfsdp.fully_shard(layer, **kw)
    mfsdp.fully_shard(ours, **kw)
    tmp = TorchMP(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # FSDP2 gathers from the shards at every forward: the reference for every strategy.
    for layer in (ref[0], ref[2], ref[4]):
        torch_fully_shard(layer, mp_policy=tmp)
    torch_fully_shard(ref, mp_policy=tmp)
    if offload == "cpu_adamw":
        opt = CPUAdamW(ours.parameters(), lr=0.02)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, foreach=False)
    elif offload == "cpu_adamw_overlapped":
        opt = CPUAdamW(ours.parameters(), lr=0.02, overlap_step=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, foreach=False)
    else:
        opt = torch.optim.SGD(ours.parameters(), lr=0.2)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    steps = 4
    for step in range(steps):
        x = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step))[rank].to(device)
        losses = []
        for model in (ours, ref):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        worst["loss"] = max(worst["loss"], abs(losses[0] - losses[1]) / abs(losses[1]))
        if step == steps - 1:
            for p, q in zip(ours.parameters(), ref.parameters()):
                g, want = _full_grad(p).cpu(), q.grad.full_tensor().flatten().float().cpu()
                worst["grad"] = max(worst["grad"], ((g.flatten() - want).norm() / want.norm()).item())
            break
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for model in (ours, ref):
            with torch.no_grad():  # an evaluation: units that keep their gathered copy keep this one
                model(x)
            for name, p in model.named_parameters():
                _post_step_write(step, name, p)
    full = mfsdp.full_state_dict(ours, rank0_only=False)
    for name, q in ref.named_parameters():
        want = q.full_tensor().float().cpu()
        worst["param"] = max(worst["param"], ((full[name].float() - want).norm() / want.norm()).item())
    return worst


class TwoUnits(nn.Module):
    """An inner unit and the root's own parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


def _two_units_sharded(plain, **kwargs):
    """A copy of `plain` with its inner unit and its root sharded by fully_shard(**kwargs)."""
    model = copy.deepcopy(plain)
    mfsdp.fully_shard(model.inner, **kwargs)
    return mfsdp.fully_shard(model, **kwargs)


def _full_values(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def functional_call_leaves_the_model(rank, world):
    """torch.func.functional_call(model, tensors, x) on a sharded model, as on a plain one:
    the call computes with the given tensors (all of them, or one), they get this rank's
    gradient, the model's parameters they replace get none, all keep their values (the tensors were once
    written into the shards, permanently), the given dict is not changed, and training
    goes on as plain PyTorch's."""
    from torch.func import functional_call

    device = device_for_backend()
    plain = TwoUnits().to(device)
    model = _two_units_sharded(plain)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 + rank)).to(device)
    for keys in (None, ["inner.weight"]):
        base = {n: p.detach() * 1.1 for n, p in plain.named_parameters() if keys is None or n in keys}
        ours = {n: v.clone().requires_grad_() for n, v in base.items()}
        theirs = {n: v.clone().requires_grad_() for n, v in base.items()}
        given = dict(ours)
        out = functional_call(model, ours, (x,))
        ref = functional_call(plain, theirs, (x,))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        assert all(ours[n] is given[n] for n in given), "functional_call's dict was changed"
        for n in ours:
            assert ours[n].grad is not None and type(ours[n].grad) is torch.Tensor, (n, type(ours[n].grad))
            torch.testing.assert_close(ours[n].grad, theirs[n].grad, rtol=1e-5, atol=1e-6, msg=n)
        for n, p in model.named_parameters():
            if n in given:  # replaced for the call: plain PyTorch gives it no gradient
                assert p.grad is None or not p.grad.detach().abs().any(), f"{n} got a gradient from functional_call"
            else:  # used by the call as it is
                assert p.grad is not None, f"{n} was used by functional_call but got no gradient"
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        full = _full_values(model)
        for n, v in plain.state_dict().items():
            torch.testing.assert_close(full[n], v, rtol=0, atol=0, msg=f"{n} changed by functional_call")
    return train_against_plain(TwoUnits, _two_units_sharded, lambda m, b: m(b).pow(2).mean())


def _add_weight_sum(module, args, output):
    return output + module.weight.sum()


def hook_reads_weight_after_fully_shard(rank, world):
    """A forward hook registered after fully_shard that reads the module's weight sees the
    whole weight (our post-forward hook stays last), as a plain module's hook does; it once
    read this rank's piece: a different loss on each rank."""
    def model_fn():
        m = TwoUnits()
        m.inner.register_forward_hook(_add_weight_sum)
        m.head.register_forward_hook(_add_weight_sum)
        return m

    def shard(m):
        for sub in (m.inner, m.head):  # registered again below, after fully_shard
            sub._forward_hooks.clear()
        mfsdp.fully_shard(m.inner)
        mfsdp.fully_shard(m)
        m.inner.register_forward_hook(_add_weight_sum)
        m.head.register_forward_hook(_add_weight_sum)
        return m
    return train_against_plain(model_fn, shard, lambda m, b: m(b).pow(2).mean())


def _norm_penalty(modules):
    return 0.05 * sum(m.weight.norm() + m.bias.norm() for m in modules)


def penalty_over_parameters(rank, world, strategy: str):
    """A norm penalty summed over the model's parameters is of each rank's piece where
    the module holds the sharded parameters (before the first forward; after the forward
    under resharding): refused in the backward on every rank, naming the parameter, also
    for a parameter frozen at fully_shard and unfrozen after it; under no_shard the piece
    is the whole parameter and the term trains as one process. The refusal's advice, the
    same penalty taken while the units hold their gathered parameters (after the forward
    with reshard_after_forward=False, or in forward hooks of the units' modules), trains
    as one process under every strategy."""
    def penalty_after_forward(m, b):
        return m(b).pow(2).mean() + _norm_penalty([m.inner, m.head])

    def penalty_in_forward_hooks(m, b):
        terms = []
        handles = [sub.register_forward_hook(lambda mod, args, out: terms.append(_norm_penalty([mod])))
                   for sub in (m.inner, m.head)]
        out = m(b)
        for h in handles:
            h.remove()
        return out.pow(2).mean() + sum(terms)

    # The other strategies keep them gathered after the forward anyway.
    kept = {"reshard_after_forward": False} if strategy == "optim_grads_params" else {}
    shard = functools.partial(_two_units_sharded, sharding_strategy=strategy, **kept)
    result = {name: train_against_plain(TwoUnits, shard, loss_fn)
              for name, loss_fn in (("after_forward", penalty_after_forward), ("hooks", penalty_in_forward_hooks))}
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank)).to(device_for_backend())
    result["refused"] = {}
    for name, penalty in (("all", lambda m: _norm_penalty([m.inner, m.head])),
                          ("unfrozen", lambda m: 0.05 * m.inner.bias.norm())):
        plain = TwoUnits().to(x.device)
        plain.inner.bias.requires_grad_(False)
        model = _two_units_sharded(plain, sharding_strategy=strategy)
        model.inner.bias.requires_grad_(True)  # its guard was registered while it was frozen
        try:
            (penalty(model) + model(x).pow(2).mean()).backward()
            result["refused"][name] = None
        except RuntimeError as e:
            result["refused"][name] = str(e)
    return result


def check_penalty_outcome(results, refused_expected: bool) -> None:
    """The assertions on penalty_over_parameters' per-rank results: both advised forms
    train as one process on every rank; the penalty over the sharded parameters is
    refused (naming the parameter, also the one unfrozen after fully_shard) exactly where
    `refused_expected`, else it passes."""
    for r, out in enumerate(results):
        for form in ("after_forward", "hooks"):
            assert out[form]["grad"] < 1e-5 and out[form]["loss"] < 1e-5, (r, form, out)
        refused = out["refused"]
        if not refused_expected:
            assert refused == {"all": None, "unfrozen": None}, (r, refused)
            continue
        assert "a gradient reached fully_shard parameter" in (refused["all"] or ""), (r, refused)
        assert "'bias' of unit 'inner'" in (refused["unfrozen"] or ""), (r, refused)


class _SkippableBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x, skip: bool):
        h = torch.tanh(self.a(x))
        return h if skip else h + self.b(h)


class PartlyUsed(nn.Module):
    """Rank-dependent control flow (LayerDrop, an expert no local token reached): on a
    batch whose first entry is positive each block skips its second layer and the model
    skips `aux`, so in a step where the ranks' batches differ in that sign some
    parameters get a gradient on some ranks only. Plain PyTorch, on the whole batch,
    gives them the mean of what the ranks that used them computed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_SkippableBlock() for _ in range(2))
        self.aux = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    @staticmethod
    def skips(x) -> bool:
        return bool(x[0, 0] > 0)

    def forward(self, x):
        skip = self.skips(x)
        for block in self.blocks:
            x = block(x, skip)
        if not skip:
            x = x + self.aux(x)
        return self.head(x)


def partly_used_parameters(rank, world, layout: str):
    """Parameters used on some ranks only get their reduced gradient on every rank (the
    rank holding their piece among them), step by step equal to plain PyTorch's. `layout`:
    "units" (a unit per block, the root holding aux), "buckets" (the same in one reduce
    bucket: the coalesced path), "root" (one unit), "hsdp" (units over a 2 x world/2 mesh)."""
    kwargs = {}
    if layout == "hsdp":
        kwargs["mesh"] = _hsdp_mesh(world)
    buckets = {"reduce_bucket_bytes": 1 << 30} if layout == "buckets" else {"reduce_bucket_bytes": 0}

    def shard(m):
        if layout != "root":
            for block in m.blocks:
                mfsdp.fully_shard(block, **kwargs)
        return mfsdp.fully_shard(m, **kwargs, **buckets)

    skipped = [[PartlyUsed.skips(torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step))[r])
                for r in range(world)] for step in range(4)]
    assert any(len(set(s)) > 1 for s in skipped), skipped  # some step is used on some ranks only
    return train_against_plain(PartlyUsed, shard, lambda m, b: m(b).pow(2).mean())


class AuxOnSomeRanks(nn.Module):
    """The root's only parameters (`aux`) are used on some ranks only, while `body` and
    `head` (units of their own) are used everywhere: a rank that did not call `aux` has no
    gradient at all in the root's unit, and must still take part in its reduction."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(D, D)
        self.aux = nn.Linear(D, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x, use_aux: bool):
        h = torch.tanh(self.body(x))
        if use_aux:
            h = h + self.aux(h)
        return self.head(h)


# Per step, the ranks that call `aux` (None: all): one, none, another, all.
_AUX_USERS = [{0}, set(), {1}, None]


def aux_unit_used_on_some_ranks(rank, world, layout: str, micro_batches: int):
    """A unit whose parameters get gradients on some ranks only, and none at all on the
    others, against one plain process on the whole batch, step by step (gradients of every
    parameter, None where no rank used it). `layout`: "units" (reduced alone), "buckets"
    (one reduce bucket: the coalesced path), "hsdp" (a 2 x world/2 mesh: the deferred
    all-reduce). With `micro_batches` > 1 the gradients accumulate with sync off and
    `aux` is called in the first micro-batch only. Returns the worst relative errors."""
    device = device_for_backend()
    kwargs = {}
    if layout == "hsdp":
        kwargs["mesh"] = _hsdp_mesh(world)
    buckets = 1 << 30 if layout == "buckets" else 0
    plain = AuxOnSomeRanks().to(device)
    model = copy.deepcopy(plain)
    mfsdp.fully_shard(model.body, **kwargs)
    mfsdp.fully_shard(model.head, **kwargs)
    mfsdp.fully_shard(model, reduce_bucket_bytes=buckets, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    worst = {"grad": 0.0, "loss": 0.0}
    for step, users in enumerate(_AUX_USERS):
        users = set(range(world)) if users is None else users
        losses, ref_losses = [], []
        for mb in range(micro_batches):
            batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(10 * step + mb)).to(device)
            calls = [r in users and mb == 0 for r in range(world)]
            ref = sum(plain(batch[r], calls[r]).pow(2).mean() for r in range(world)) / (world * micro_batches)
            ref.backward()
            ref_losses.append(ref.item())
            if micro_batches > 1:
                model.set_requires_gradient_sync(mb == micro_batches - 1)
            loss = model(batch[rank], calls[rank]).pow(2).mean() / micro_batches
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        worst["loss"] = max(worst["loss"], abs(sum(losses) - sum(ref_losses)) / abs(sum(ref_losses)))
        _step_and_compare(model, plain, opt, ref_opt, step, worst, unused_ok=True)
    return worst


def zero_grad_drops_a_discarded_micro_batch(rank, world, layout: str):
    """`model.zero_grad()` after a micro-batch whose gradients were not synced (a bad batch
    skipped mid-accumulation) drops them, as plain PyTorch drops them from .grad: the step
    then uses the later micro-batches only. `layout`: "no_sync" (set_requires_gradient_sync
    (False) on the discarded micro-batch), "hsdp_deferred" (a 2 x world/2 mesh with
    set_requires_all_reduce(False): the reduced shards wait in the partial sum). Returns the
    worst relative errors against one plain process."""
    device = device_for_backend()
    kwargs = {}
    if layout == "hsdp_deferred":
        kwargs["mesh"] = _hsdp_mesh(world)
    plain = AuxOnSomeRanks().to(device)
    model = copy.deepcopy(plain)
    for m in (model.body, model.head, model):
        mfsdp.fully_shard(m, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    worst = {"grad": 0.0}
    for step in range(3):
        for mb in range(3):  # the second is discarded (zero_grad after it), at step 1 only
            batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(10 * step + mb)).to(device)
            discard = step == 1 and mb == 1
            ref = sum(plain(batch[r], True).pow(2).mean() for r in range(world)) / (world * 3)
            ref.backward()
            last = mb == 2
            if layout == "hsdp_deferred":
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            (model(batch[rank], True).pow(2).mean() / 3).backward()
            if discard:
                plain.zero_grad()
                model.zero_grad()
        _step_and_compare(model, plain, opt, ref_opt, step, worst)
    return worst


def _three_blocks():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5))


def _shard_blocks(model, **kwargs):
    for m in (model[0], model[2], model):
        mfsdp.fully_shard(m, **kwargs)
    return model


def gradient_idioms(rank, world):
    """What training scripts write around the gradients, on ours as on one plain process
    (FSDP2's DTensors give the plain results): optimizer groups chosen by
    `p.ndimension() < 2`; a gradient replaced out of place (`p.grad = p.grad / 2`, L2 added
    to it) before torch's clip; the total norm MAE and BEiT log,
    `torch.norm(torch.stack([torch.norm(p.grad.detach(), 2) for p in ...]), 2)`, and
    `p.grad.data.norm()`. Each once gave each rank's own value, silently. Returns the
    worst relative error of the norms."""
    device = device_for_backend()
    plain = _three_blocks().to(device)
    model = _shard_blocks(copy.deepcopy(plain))

    def groups(m):
        decay = [p for p in m.parameters() if p.ndimension() >= 2]
        rest = [p for p in m.parameters() if p.ndimension() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    assert [len(g["params"]) for g in groups(model)] == [len(g["params"]) for g in groups(plain)] == [3, 3]
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(groups(plain), lr=1e-2)
    worst = 0.0
    for step in range(3):
        batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step)).to(device)
        (sum(plain(batch[r]).pow(2).mean() for r in range(world)) / world).backward()
        model(batch[rank]).pow(2).mean().backward()
        norms = []
        for m in (model, plain):
            for p in m.parameters():
                p.grad = p.grad / 2 + 1e-3 * p.detach()
            mae = torch.norm(torch.stack([torch.norm(p.grad.detach(), 2) for p in m.parameters()]), 2)
            by_data = [p.grad.data.norm() for p in m.parameters()]
            clipped = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            norms.append([mae.item(), clipped.item()] + [n.item() for n in by_data])
        for got, want in zip(*norms):
            err = abs(got - want) / abs(want)
            assert err < 1e-5, f"step {step}: norms {norms[0]} against one process's {norms[1]}"
            worst = max(worst, err)
        for p, q in zip(model.parameters(), plain.parameters()):
            g = _full_grad(p)
            assert torch.allclose(g, q.grad.reshape(g.shape), rtol=1e-5, atol=1e-7), f"step {step}: clipped gradient"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, q in plain.named_parameters():
        full = model.state_dict()[name].full_tensor()
        assert torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-6), f"'{name}' after the steps"
    return worst


def flat_gradient_vectors(rank, world, layout: str = "units"):
    """PCGrad on one flat gradient vector per task, as multi-task code writes it:
    `parameters_to_vector` of the gradients (global, as of FSDP2's DTensors), the dot
    product and projection on the full vectors, then the vector written back by
    `p.grad = vec[i:i + n].view(p.shape)` (this rank's part is kept) and stepped. Against
    one plain process doing the same on the whole batch. The spelling that would be of
    pieces, `torch.cat([p.grad.view(-1) ...])`, once gave every rank its own vector (length,
    dot and projection local, silently): refused on every rank where pieces are split;
    a 1-D gradient's own flattening stays a gradient whose norm is global."""
    from torch.nn.utils import parameters_to_vector

    device = device_for_backend()
    plain = _three_blocks().to(device)
    model = copy.deepcopy(plain)
    if layout == "units":
        _shard_blocks(model)
    else:
        mfsdp.fully_shard(model, sharding_strategy=layout)
    split = layout != "no_shard" and world > 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def task_losses(m, x):
        out = m(x)
        return out[:, :2].pow(2).mean(), (out[:, 2:] - 1).pow(2).mean() - out[:, :2].mean()

    def pcgrad(m, o, xs):
        vectors = []
        for task in range(2):
            o.zero_grad()
            (sum(task_losses(m, x)[task] for x in xs) / len(xs)).backward()
            vectors.append(parameters_to_vector([p.grad for p in m.parameters()]).clone())
        g1, g2 = vectors
        dot = torch.dot(g1, g2)
        g = g1 + g2 - (dot / g2.norm() ** 2 * g2 if dot < 0 else 0)
        offset = 0
        for p in m.parameters():
            p.grad = g[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return dot.item(), g

    projected = 0
    worst = 0.0
    for step in range(4):
        batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step)).to(device)
        want_dot, want = pcgrad(plain, ref_opt, list(batch))
        got_dot, got = pcgrad(model, opt, [batch[rank]])
        projected += want_dot < 0
        assert got.shape == want.shape and abs(got_dot - want_dot) <= 1e-5 * abs(want_dot), (step, got_dot, want_dot)
        for p, q in zip(model.parameters(), plain.parameters()):
            g = _full_grad(p)
            err = ((g - q.grad.reshape(g.shape)).norm() / q.grad.norm()).item()
            assert err < 1e-5, f"step {step}: the written-back gradient is off by {err:.2e}"
            worst = max(worst, err)
        weight, bias = model[2].weight, model[2].bias
        for spell in (lambda: torch.cat([p.grad.view(-1) for p in model.parameters()]),
                      lambda: weight.grad.flatten(), lambda: weight.grad.reshape(-1),
                      lambda: torch.cat([b.grad for b in (model[0].bias, bias)])):
            if split:
                try:
                    spell()
                except RuntimeError as e:
                    assert "would be of this rank's 1-D piece" in str(e), e
                else:
                    raise AssertionError(f"step {step}: a flat vector of gradient pieces was not refused")
            else:
                spell()  # the pieces are the gradients: nothing to refuse
        bias_norm = bias.grad.view(-1).norm().item()
        assert abs(bias_norm - plain[2].bias.grad.norm().item()) <= 1e-5 * bias_norm, "a 1-D gradient's view(-1)"
        opt.step()
        ref_opt.step()
    assert projected, "the data never made the task gradients conflict: the projection was not exercised"
    weights = mfsdp.full_state_dict(model, rank0_only=False)  # our gather: no DTensor collectives (Gloo + CUDA)
    for name, q in plain.named_parameters():
        full = weights[name].to(q.device)
        assert torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-6), f"'{name}' after the steps"
    return worst


def _read(x):
    return x.tolist() if isinstance(x, torch.Tensor) else x


def gradient_statistics(rank, world, layout: str):
    """Reductions of gradients besides their norm, as training scripts log and check them
    (`sum((p.grad ** 2).sum() ...)`, `p.grad.abs().max()`, `torch.isfinite(p.grad).all()`
    before a step, mean / std / count), against one plain process on the whole batch:
    FSDP2's DTensor gradients give these; our pieces gave each rank's own, silently (a
    NaN check skipped the step on some ranks only). A NaN in one row must be seen by every
    rank, and a step skipped on it skipped everywhere. `layout`: "units" (a unit per
    block and the root) or "hsdp" (the same over a 2 x world/2 mesh). Returns the worst
    absolute error per statistic (booleans as 0/1)."""
    from .workers import expect_error

    kwargs = {}
    if layout == "hsdp":
        kwargs["mesh"] = _hsdp_mesh(world)
    device = device_for_backend()
    plain = _three_blocks().to(device)
    model = _shard_blocks(copy.deepcopy(plain), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    stats = {
        "sq_sum": lambda ps: sum((p.grad ** 2).sum() for p in ps),
        "stacked_pow_sum": lambda ps: torch.stack([p.grad.pow(2).sum() for p in ps]).sum().sqrt(),
        "abs_max": lambda ps: max(p.grad.abs().max() for p in ps),
        "stacked_amax": lambda ps: torch.stack([p.grad.abs().amax() for p in ps]).max(),
        "sum": lambda ps: sum(torch.sum(p.grad) for p in ps),
        "mean": lambda ps: torch.stack([p.grad.mean() for p in ps]),
        "mean_f64": lambda ps: torch.stack([p.grad.mean(dtype=torch.float64) for p in ps]),
        "min": lambda ps: min(p.grad.min() for p in ps),
        "count_positive": lambda ps: sum(torch.count_nonzero(p.grad > 0) for p in ps),
        "std": lambda ps: torch.stack([p.grad.std() for p in ps]),
        "var_biased": lambda ps: torch.stack([p.grad.var(correction=0) for p in ps]),
        "grad_dot_param": lambda ps: sum((p.grad * p.detach()).sum() for p in ps),
        "float_abs_sum": lambda ps: sum(p.grad.float().abs().sum() for p in ps),
        "bias_sum_dim0": lambda ps: torch.stack([p.grad.sum(dim=0) for p in ps if p.ndim == 1]),
        "finite_each": lambda ps: torch.stack([torch.isfinite(p.grad).all() for p in ps]).float(),
        "nan_any": lambda ps: float(any(bool(torch.isnan(p.grad).any()) for p in ps)),
        # A copy kept to compare with later gradients (gradient noise, cosine between steps).
        "clone_norm": lambda ps: torch.stack([p.grad.clone().norm() for p in ps]),
        "torch_clone_sq_sum": lambda ps: sum(torch.clone(p.grad).square().sum() for p in ps),
        "accumulated_norm": lambda ps: torch.stack([torch.zeros_like(p.grad).add_(p.grad).norm() for p in ps]),
        "detached_clone_cosine": lambda ps: torch.stack([
            (p.grad * p.grad.detach().clone()).sum() / (p.grad.norm() * p.grad.detach().clone().norm())
            for p in ps]),
    }
    worst = {}
    for step in range(3):
        batch = torch.randn(world, 4, D, generator=torch.Generator().manual_seed(step)).to(device)
        (sum(plain(batch[r]).pow(2).mean() for r in range(world)) / world).backward()
        model(batch[rank]).pow(2).mean().backward()
        if step == 1:  # a NaN in one row of the middle weight: on one rank's piece only
            with torch.no_grad():
                model[2].weight.grad[5] = float("nan")
                plain[2].weight.grad[5] = float("nan")
        with torch.no_grad():
            for name, f in stats.items():
                # read as scripts read them (.tolist() / .item(): on every rank)
                got = torch.tensor(_read(f(list(model.parameters()))), dtype=torch.float64)
                want = torch.tensor(_read(f(list(plain.parameters()))), dtype=torch.float64)
                assert torch.equal(torch.isnan(got), torch.isnan(want)), f"step {step} {name}: {got} vs {want}"
                err = float((got - want).nan_to_num().abs().max())
                worst[name] = max(worst.get(name, 0.0), err)
        expect_error(lambda: model[0].weight.grad.sum(dim=0), NotImplementedError, "dim=0", "1-D piece",
                     "full_tensor")
        for m, o in ((model, opt), (plain, ref_opt)):  # an AMP-style skip of a non-finite step
            if all(bool(torch.isfinite(p.grad).all()) for p in m.parameters()):
                o.step()
            o.zero_grad()
    full = mfsdp.full_state_dict(model, rank0_only=False)  # our gather: no DTensor collectives
    for name, q in plain.named_parameters():
        worst["params_after"] = max(worst.get("params_after", 0.0),
                                    float((full[name].to(q.device) - q.detach()).abs().max()))
    return worst


class Lamb(torch.optim.SGD):
    """Stands for timm's / apex's LAMB (known by class name; its step is never reached)."""


def trust_ratio_optimizers_refused(rank, world):
    """An optimizer known by name to compute on whole parameters (LAMB's trust ratio) is
    refused at its first step on every rank, not run on the pieces."""
    from .workers import expect_error

    model = _shard_blocks(_three_blocks().to(device_for_backend()))
    opt = Lamb(model.parameters(), lr=0.1)
    model(torch.randn(2, D, device=device_for_backend())).sum().backward()
    expect_error(opt.step, NotImplementedError, "Lamb", "trust ratio", "1-D piece")
    # torchao's low-bit Adams (their quantized state is sized from the whole parameter:
    # they once failed inside torchao with a broadcast error); its full-precision _AdamW
    # steps, and a class of the same name from another library is not taken for them.
    try:
        import torchao.optim as ao
    except ImportError:
        return
    for cls in (ao.AdamW8bit, ao.AdamW4bit, ao.AdamWFp8):
        expect_error(cls(model.parameters(), lr=1e-3).step, NotImplementedError, cls.__name__, "torchao",
                     "_AdamW")
    for opt in (ao._AdamW(model.parameters(), lr=1e-3), AdamW8bit(model.parameters(), lr=1e-3)):
        opt.step()


class AdamW8bit(torch.optim.AdamW):
    """Another library's class of a torchao low-bit optimizer's name (bitsandbytes has one)."""


def ema_swap_through_data(rank, world, strategy: str = "optim_grads_params"):
    """An EMA swap through `.data` (`p.data, e.data = e.data, p.data` to evaluate with the
    averaged weights, the same again to go back) on ours as on one plain process: the
    evaluation sees the averaged weights, and the training weights come back unchanged.
    The value `p.data` handed out viewed the unit's flat shard, so writing the swapped-in
    weights there once overwrote the saved ones: training went on from the EMA's.
    (no_shard: the unsharded parameters view the shard and move with it.)"""
    device = device_for_backend()
    plain = _three_blocks().to(device)
    model = _shard_blocks(copy.deepcopy(plain), sharding_strategy=strategy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(3)).to(device)
    for m, opt in zip((model, plain), opts):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    emas = [[p.detach().clone() * 0.5 for p in m.parameters()] for m in (model, plain)]
    trained = [[p.detach().clone() for p in m.parameters()] for m in (model, plain)]
    outs = []
    for m, ema in zip((model, plain), emas):
        with torch.no_grad():
            for p, e in zip(m.parameters(), ema):
                p.data, e.data = e.data, p.data
            outs.append(m(x))
            for p, e in zip(m.parameters(), ema):
                p.data, e.data = e.data, p.data
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6), "the forward with the EMA weights swapped in"
    for m, before in zip((model, plain), trained):
        for p, b in zip(m.parameters(), before):
            assert torch.equal(p.detach(), b), "the training weights after the swap back"
    for m, opt in zip((model, plain), opts):
        m(x).pow(2).mean().backward()
        opt.step()
    for name, q in plain.named_parameters():
        full = model.state_dict()[name]
        full = full.full_tensor() if hasattr(full, "full_tensor") else full
        assert torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-6), f"'{name}' after a step past the swaps"
    return True


def freeze_between_forward_and_backward(rank, world, strategy: str = "optim_grads_params"):
    """`requires_grad_(False)` on a parameter between forward and backward, on ours as on
    one plain process: its gradient is None and the step leaves it alone, and it stays
    frozen until unfrozen. Between forward and backward the root (and units that keep
    their unsharded parameters) hold the unsharded objects in the modules, so the freeze
    lands on those; the next install once gave them the sharded parameter's
    requires_grad back and the parameter trained. (FSDP2 honours the freeze for that
    backward and trains the parameter again from the next step.)"""
    device = device_for_backend()
    plain = _three_blocks().to(device)
    model = _shard_blocks(copy.deepcopy(plain), sharding_strategy=strategy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    x = torch.randn(world * 4, D, generator=torch.Generator().manual_seed(5)).to(device)
    rows = slice(rank * 4, (rank + 1) * 4)
    for step in range(4):
        for m, batch in ((model, x[rows]), (plain, x)):
            if step == 2:  # unfrozen before the forward: the sharded parameter the user sees
                m[2].weight.requires_grad_(True)
            loss = m(batch).pow(2).mean()
            if step == 0:  # the root's head (unsharded now) and a block's weight
                m[4].weight.requires_grad_(False)
                m[2].weight.requires_grad_(False)
            loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert p.requires_grad == q.requires_grad, (step, name)
            assert (p.grad is None) == (q.grad is None), (step, name, p.grad is None, q.grad is None)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for name, q in plain.named_parameters():
            full = model.state_dict()[name]
            full = full.full_tensor() if hasattr(full, "full_tensor") else full
            tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels may sum in another order
            assert torch.allclose(full, q.detach(), rtol=tol, atol=tol / 10), f"step {step}: '{name}'"
    return True


def _full_value(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def row_writes(rank, world, strategy: str = "optim_grads_params"):
    """Writes to whole rows of a parameter or gradient outside the forward, on ours as on
    one plain process: Hugging Face's `init.zeros_(emb.weight[padding_idx])`, the older
    `emb.weight.data[pad].zero_()`, slices and assignments of rows, and on gradients
    `emb.weight.grad[:n_old] = 0` (train only new token rows) and `g[torch.isnan(g)] = 0`.
    On the 1-D piece each once wrote element i of every rank's piece instead of row i
    (or raised on a rank whose piece is short). Writes to parts of rows, scattered
    indices and pieces as values are refused by name on every rank."""
    from torch.nn import init

    device = device_for_backend()
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Embedding(13, D), nn.Linear(D, D), nn.Linear(D, 5)).to(device)
    model = copy.deepcopy(plain)
    for m in model[:2]:
        mfsdp.fully_shard(m, sharding_strategy=strategy)
    mfsdp.fully_shard(model, sharding_strategy=strategy)
    row = torch.arange(D, dtype=torch.float32, device=device)
    with torch.no_grad():
        for m in (model, plain):
            emb, lin = m[0].weight, m[1].weight
            init.zeros_(emb[3])
            emb.data[5].zero_()
            emb[7:9] = 1.5
            emb.data[-1] = row
            emb[1].copy_(row * 2)
            emb.data[2, :].mul_(0)
            emb[10:] += 1  # read, add, write back: rows 10-12
            lin[0] = row.flip(0)
            lin.data[...] *= 0.5
            emb.data[4][1] = 5.0  # indexing again selects within the row
            emb.data[9][:] = row
            emb.data[6].add_(torch.ones(D, device=device))  # an operand of the row's shape
            emb[11:13].mul_(row)  # broadcast over the rows
            emb[12] += emb[12] * 2
            full_mask = torch.zeros(13, D, dtype=torch.bool, device=device)
            full_mask[::3, 1::2] = True
            emb[full_mask] = -1.0  # a mask of the parameter's shape
            emb[full_mask.flip(0)] = torch.arange(int(full_mask.sum()), dtype=torch.float32, device=device)
            bias = m[1].bias  # often whole on one rank: a mask of its shape decides alike everywhere
            bias[torch.ones(bias.shape, dtype=torch.bool, device=device)] = 7.0
    reset = [nn.Embedding(13, D, padding_idx=12).to(device) for _ in range(2)]
    mfsdp.fully_shard(reset[0], sharding_strategy=strategy)
    for e in reset:  # torch's own reset_parameters writes weight[padding_idx]
        torch.manual_seed(9)
        e.reset_parameters()
    assert torch.equal(_full_value(reset[0].state_dict()["weight"]), reset[1].weight.detach())
    assert torch.equal(copy.deepcopy(model[0].weight.data), model[0].weight.detach())
    shown = repr(model[0].weight.data)  # the piece as it is, not rows of it
    assert "this rank's piece" in shown and f"({13}, {D})" in shown, shown
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(_full_value(model.state_dict()[name]), q.detach()), f"'{name}' after the row writes"
    if strategy != "no_shard" and world > 1:
        w = model[0].weight
        for bad in (lambda: w[:, 0], lambda: w[::2], lambda: w[torch.tensor([1, 2])],
                    lambda: w.data.__setitem__((slice(None), 0), 0.0), lambda: w[0, 1], lambda: w[True],
                    lambda: w[None], lambda: w[torch.ones(5, dtype=torch.bool)],
                    lambda: model[1].weight.data.__setitem__(0, model[0].weight[0]),
                    lambda: w[0:2].add_(w[2:4]), lambda: w[0].add_(model[0].weight),
                    lambda: model[1].weight.__setitem__(slice(0, 2), model[1].weight[0:2] * 2)):
            with pytest.raises(RuntimeError, match="fully_shard parameter or gradient"):
                with torch.no_grad():
                    bad()
        with pytest.raises(IndexError, match="too many indices"):
            w[0, :, :]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels may sum in another order
    ids = torch.randint(0, 13, (world, 6), generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(2):
        (sum(plain(ids[r]).pow(2).mean() for r in range(world)) / world).backward()
        model(ids[rank]).pow(2).mean().backward()
        for m in (model, plain):
            g = m[0].weight.grad
            g[:4] = 0  # old token rows stay as they are
            g[torch.isnan(g)] = 0
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(_full_value(p.grad), q.grad, rtol=tol, atol=tol / 100,
                                       msg=lambda msg: f"step {step}: gradient of '{name}': {msg}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full_value(model.state_dict()[name]), q.detach(), rtol=tol, atol=tol / 10)
    return True


def hf_init_weights_after_fully_shard(rank, world):
    """Hugging Face's own `_init_weights` applied after fully_shard (a Llama with a pad
    token: `init.zeros_(embed_tokens.weight[padding_idx])`) gives one plain process's
    values for the seed, the padding row zero."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=5, tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg)
    model = copy.deepcopy(plain)
    for layer in model.model.layers:
        mfsdp.fully_shard(layer)
    mfsdp.fully_shard(model)
    for m in (model, plain):
        for p in m.parameters():
            p.__dict__.pop("_is_hf_initialized", None)
        torch.manual_seed(11)
        m.apply(m._init_weights)
    assert plain.model.embed_tokens.weight[5].abs().sum() == 0
    for name, q in plain.named_parameters():
        assert torch.equal(_full_value(model.state_dict()[name]), q.detach()), f"'{name}' after _init_weights"
    return True


def gradient_hooks(rank, world, strategy: str = "optim_grads_params"):
    """Tensor.register_hook on parameters, before fully_shard (PEFT's CPT registers its
    gradient mask in the model's constructor) and after it, gives one plain process's
    gradients with the same hooks: each hook runs on this rank's local full-shape
    gradient before the reduction, as on each DDP rank (the hooks here are linear, so the
    mean of the hooked local gradients is the hooked whole-batch gradient). A removed hook
    no longer runs, whichever object it was registered on. (On FSDP2 such hooks never run.)"""
    device = device_for_backend()

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11)).to(device)

    mask = torch.ones(11, 1, device=device)
    mask[3:7] = 0  # rows of the embedding that must not train

    def hook_before(m):
        return m[0].weight.register_hook(lambda g: g * mask)

    plain, model = build(), build()
    handles = [hook_before(plain), hook_before(model)]
    for layer in (model[1], model[3]):
        mfsdp.fully_shard(layer, sharding_strategy=strategy)
    mfsdp.fully_shard(model, sharding_strategy=strategy)
    calls = {"plain": 0, "ours": 0}

    def scale(name):
        def hook(g):
            calls[name] += 1
            return g * 3.0
        return hook

    after = [plain[3].weight.register_hook(scale("plain")), model[3].weight.register_hook(scale("ours"))]
    removed = [m[1].bias.register_hook(lambda g: g * 0.0) for m in (plain, model)]
    for h in removed:
        h.remove()
    ids = torch.randint(0, 11, (world, 5), generator=torch.Generator().manual_seed(1)).to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain)]
    tol = 1e-5 if device.type == "cpu" else 1e-4  # CUDA kernels may sum in another order
    for step in range(3):
        if step == 2:  # hooks removed through their handles: neither model runs them any more
            for h in handles + after:
                h.remove()
        (sum(plain(ids[r]).pow(2).mean() for r in range(world)) / world).backward()
        model(ids[rank]).pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(_full_value(p.grad), q.grad, rtol=tol, atol=tol / 10,
                                       msg=lambda msg: f"step {step}: gradient of '{name}': {msg}")
        if step < 2:
            assert _full_value(model[0].weight.grad)[3:7].abs().sum() == 0, "the mask hook did not run"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert calls == {"plain": 2, "ours": 2}, calls  # once per backward while registered
    return True
