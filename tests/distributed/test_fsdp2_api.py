"""FSDP2's spelling of fully_shard's arguments: torch's MixedPrecisionPolicy and a 1-D
DeviceMesh behave exactly like our policy and process group (same losses, same
parameters, bit for bit); what is not supported raises a clear error instead of being
taken silently."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.states import SlotsHold
from harness import run_distributed
from harness.drop_in_workers import mlp as _model, shard_mlp as _shard


def _train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x = torch.randn(8, 16, generator=g)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _same_training(a, b):
    (la, pa), (lb, pb) = _train(a), _train(b)
    assert la == lb, (la, lb)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


def _fsdp2_arguments(rank, world):
    ours = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    a, b = _shard(_model(), mp_policy=ours), _shard(_model(), mp_policy=theirs)
    assert b._fsdp_state.options.mp_policy == ours
    _same_training(a, b)

    mesh = init_device_mesh("cpu", (world,))
    a, b = _shard(_model()), _shard(_model(), mesh=mesh, offload_policy=OffloadPolicy())
    assert dist.get_process_group_ranks(b._fsdp_state.process_group) == list(range(world))
    _same_training(a, b)

    m = _model()
    with pytest.raises(ValueError, match=r"1-D mesh \(FSDP\) or a 2-D mesh .* got a 3-D mesh"):
        mfsdp.fully_shard(m, mesh=init_device_mesh("cpu", (1, 1, world)))
    with pytest.raises(ValueError, match="either mesh or process_group"):
        mfsdp.fully_shard(m, mesh=mesh, process_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="mesh must be a"):
        mfsdp.fully_shard(m, mesh=dist.group.WORLD)
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool, an int or None, got 2.0"):
        mfsdp.fully_shard(m, reshard_after_forward=2.0)
    with pytest.raises(TypeError, match=r"offload_policy must be None, OffloadPolicy\(\) or CPUOffloadPolicy"):
        mfsdp.fully_shard(m, offload_policy="cpu")
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        mfsdp.fully_shard(m, offload_policy=CPUOffloadPolicy(pin_memory="yes"))
    # Named as the unit is named until the root's lazy init gives it its path: its module type(s).
    with pytest.raises(ValueError, match="CPU offload of unit 'Sequential' needs a sharding strategy that "
                                         r"reduce-scatters gradients \('optim_grads_params' or 'optim_grads'\), not "
                                         "'no_shard'"):
        mfsdp.fully_shard(m, offload_policy=CPUOffloadPolicy(pin_memory=False), sharding_strategy="no_shard")
    with pytest.raises(ValueError, match="CPU offload of unit 'Linear\\+Linear' needs .* not 'optim'"):
        mfsdp.fully_shard([m[0], m[2]], offload_policy=CPUOffloadPolicy(), sharding_strategy="optim")
    with pytest.raises(ValueError, match=r"shard_placement_fn returned Replicate\(\) for parameter '0.weight': only"):
        mfsdp.fully_shard(m, shard_placement_fn=lambda p: Replicate())
    with pytest.raises(ValueError, match=r"Shard\(2\) for parameter '0.weight' of shape \(32, 16\), which has no dim 2"):
        mfsdp.fully_shard(m, shard_placement_fn=lambda p: Shard(2))
    with pytest.raises(TypeError, match="shard_placement_fn must be callable"):
        mfsdp.fully_shard(m, shard_placement_fn=Shard(0))
    with pytest.raises(ValueError, match="same module twice"):
        mfsdp.fully_shard([m[0], m[0]])
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        mfsdp.fully_shard(m, mp_policy="bf16")
    assert not isinstance(m, mfsdp.FSDPModule)  # every refusal left the module untouched
    return True


def test_fsdp2_arguments(tmp_path):
    assert run_distributed(_fsdp2_arguments, 2, timeout=120) == [True, True]


def _by_columns(param):
    """torchtitan's MoE kind of shard_placement_fn: dim 1 for matrices, the default otherwise."""
    return Shard(1) if param.dim() == 2 else None


def _shard_placement_fn(rank, world):
    """shard_placement_fn=Shard(1): training is what it is without it, and the state dicts
    (model and optimizer) hold FSDP2's DTensors under the same function, placement and
    local values alike; they load back, and a checkpoint moves to a model without it."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    ours, plain = _shard(_model(), shard_placement_fn=_by_columns), _shard(_model())
    theirs = _model()
    for i in (0, 2):
        fsdp2_shard(theirs[i], shard_placement_fn=_by_columns)
    fsdp2_shard(theirs, shard_placement_fn=_by_columns)
    _same_training(ours, plain)
    _train(theirs)  # the same three steps _same_training gave ours
    sd, ref = ours.state_dict(), theirs.state_dict()
    assert sd.keys() == ref.keys()
    for key, value in sd.items():
        assert isinstance(value, DTensor) and value.placements == ref[key].placements, (key, value.placements)
        torch.testing.assert_close(value.to_local(), ref[key].to_local(), rtol=1e-5, atol=1e-6, msg=key)
    opt = torch.optim.AdamW(ours.parameters(), lr=0.01)
    _train_with(ours, opt)
    osd = get_optimizer_state_dict(ours, opt)
    weight = osd["state"]["0.weight"]["exp_avg"]
    assert weight.placements == (Shard(1),) and weight.to_local().shape == (32, 16 // world)
    fresh = _shard(_model(), shard_placement_fn=_by_columns)
    fresh.load_state_dict(ours.state_dict())
    default = _shard(_model())
    default.load_state_dict(ours.state_dict())  # Shard(1) DTensors into Shard(0) units: gathered, cut
    for a, b, c in zip(ours.parameters(), fresh.parameters(), default.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    return True


def _train_with(model, opt):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_shard_placement_fn_places_state_dicts_as_fsdp2(tmp_path):
    assert run_distributed(_shard_placement_fn, 2, timeout=120) == [True, True]


class Generator(nn.Module):
    """generate() reads a root parameter outside forward, around forward calls (as
    Hugging Face's generate does with the tied embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h @ self.emb.weight.t()

    def score(self, tokens):  # a training entry point other than forward
        return self(tokens).pow(2).mean() + 1e-3 * self.emb.weight.pow(2).sum()

    @torch.no_grad()
    def generate(self, tokens, steps):
        for _ in range(steps):
            logits = self(tokens)[:, -1] + self.emb.weight.sum(1)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        return tokens


def _sharded_generator(strategy):
    model = Generator()
    for block in model.blocks:
        mfsdp.fully_shard(block, sharding_strategy=strategy)
    return mfsdp.fully_shard(model, sharding_strategy=strategy)


def _forward_methods(rank, world):
    ref = Generator()
    prompt = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    for strategy in ("optim_grads_params", "optim"):
        model = _sharded_generator(strategy)
        if strategy == "optim_grads_params":
            with pytest.raises((IndexError, RuntimeError)):  # unregistered: the root's weight is a 1-D shard
                model.generate(prompt, 2)
            model.reshard()
        mfsdp.register_fsdp_forward_method(model, "generate")
        assert torch.equal(model.generate(prompt, 4), ref.generate(prompt, 4))
        assert model._fsdp_state.slots_hold is SlotsHold.SHARDED and model.emb.weight.detach().dim() == 1, (strategy, model._fsdp_state.slots_hold, model.emb.weight.shape)
        # training goes on as in plain PyTorch after generating, also through a
        # registered method with grad (its backward reduces like forward's)
        mfsdp.register_fsdp_forward_method(model, "score")
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        for m, o in ((model, opt), (ref, ref_opt)):
            m.score(prompt).backward()
            o.step()
            o.zero_grad()
        full = mfsdp.full_state_dict(model, rank0_only=False)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-6)
        ref = Generator()
    with pytest.raises(ValueError, match="forward is already driven"):
        mfsdp.register_fsdp_forward_method(model, "forward")
    with pytest.raises(AttributeError, match="no method 'sample'"):
        mfsdp.register_fsdp_forward_method(model, "sample")
    with pytest.raises(TypeError, match="needs a fully_shard module"):
        mfsdp.register_fsdp_forward_method(Generator(), "generate")

    model.set_is_last_backward(True)
    model.set_requires_all_reduce(True)
    model.set_requires_all_reduce(False)  # nothing to defer without a replicate dimension (as in FSDP2)
    model.set_requires_all_reduce(True)
    for call in (lambda: model.set_post_optim_event(None),
                 lambda: model.set_all_reduce_hook(lambda g: None), lambda: model.set_custom_all_gather(None),
                 lambda: model.set_custom_reduce_scatter(None), lambda: model.share_comm_ctx([])):
        with pytest.raises(NotImplementedError, match="not supported by megatron_fsdp_ext: .+"):
            call()
    return True


def test_register_fsdp_forward_method_and_fsdp2_module_methods():
    assert run_distributed(_forward_methods, 2, timeout=120) == [True, True]


def _units(model):
    return [m for m in model.modules() if isinstance(m, mfsdp.FSDPModule)]


def _grads_after_one_backward(model, rank):
    g = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(8, 16, generator=g)).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _divide_factors(rank, world):
    mean = _grads_after_one_backward(_shard(_model()), rank)
    summed_model = _shard(_model())
    for m in _units(summed_model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # ours always sums then scales: no change
    summed = _grads_after_one_backward(summed_model, rank)
    halved_model = _shard(_model())
    for m in _units(halved_model):
        m.set_reduce_scatter_divide_factor(float(2 * world))
    halved = _grads_after_one_backward(halved_model, rank)
    for a, b, c in zip(mean, summed, halved):
        torch.testing.assert_close(b, a * world, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a / 2, rtol=1e-6, atol=1e-7)
    for bad in (0, -1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="finite number > 0"):
            summed_model.set_gradient_divide_factor(bad)
    return True


def _micro_batch(model, rank, k):
    g = torch.Generator().manual_seed(1000 * k + rank)
    model(torch.randn(8, 16, generator=g)).float().pow(2).mean().backward()


def _divide_factor_changed_while_accumulating(rank, world):
    """The divide factor in effect when gradients are reduced applies to all of them, as in
    FSDP2 (which reduces what it accumulated at the synced backward): ours scales the
    gradients as it packs them, so what was packed under another factor is rescaled, and a
    deferred HSDP all-reduce (set_requires_all_reduce(False)) keeps its shards' factor too.
    Per unit, in a reduce bucket (all units in one reduce-scatter) and all-reduced whole
    (no_shard); on a 2x2 HSDP mesh at world 4. The reference takes the three micro-batches
    synced under the final factor, adding in .grad."""
    if world >= 4:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        cases = [("hsdp", {"mesh": mesh}, "sync"), ("hsdp", {"mesh": mesh}, "all_reduce")]
    else:
        cases = [("per unit", {"reduce_bucket_bytes": 0}, "sync"),
                 ("one reduce bucket", {"reduce_bucket_bytes": 1 << 20}, "sync"),
                 ("no_shard", {"sharding_strategy": "no_shard"}, "sync")]
    for what, kwargs, hold in cases:
        reference = _shard(_model(), **kwargs)
        for m in _units(reference):
            m.set_gradient_divide_factor(3.0)  # not a power of two: a rescale is not exact by luck
        for k in (1, 2, 3):
            _micro_batch(reference, rank, k)
        expected = [p.grad.to_local().clone() for p in reference.parameters()]
        model = _shard(_model(), **kwargs)
        if hold == "sync":
            model.set_requires_gradient_sync(False)  # accumulated unreduced, at the default factor
        else:
            model.set_requires_all_reduce(False)  # reduce-scattered now, all-reduced later
        _micro_batch(model, rank, 1)
        for factor, k in ((5.0, 2), (3.0, 3)):  # changed again while holding
            for m in _units(model):
                m.set_gradient_divide_factor(factor)
            if k == 3:
                model.set_requires_gradient_sync(True)
                model.set_requires_all_reduce(True)
            _micro_batch(model, rank, k)
        for name, (got, want) in enumerate(zip([p.grad.to_local() for p in model.parameters()], expected)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{what}, {hold}, parameter {name}: {m}")
    return True


def _fp16_reduction_scales_after_the_sum(rank, world):
    """An fp16 reduction sums the gradients as they are and scales after, in fp32: 1/W
    applied first would round small fp16 gradients away. Every rank's gradient here is
    3 * 2^-24 (three steps of fp16's smallest subnormal): the sum of four is exact in fp16
    and a quarter of it exact in fp32, while a quarter of each first would round to one step."""
    value = 3 * 2.0**-24
    model = nn.Sequential(nn.Linear(16, 4, bias=False))
    mfsdp.fully_shard(model, mp_policy=mfsdp.MixedPrecisionPolicy(reduce_dtype=torch.float16))
    (model(torch.ones(1, 16)) * value).sum().backward()
    grad = model[0].weight.grad
    assert torch.equal(grad, torch.full_like(grad, value)), grad.unique()
    return True


def _reshard_after_backward(rank, world):
    kept = _shard(_model())
    kept.set_reshard_after_backward(False)
    _grads_after_one_backward(kept, rank)
    assert all(m._fsdp_state.unit.unsharded_storage_bytes > 0 for m in (kept[0], kept[2])), \
        "set_reshard_after_backward(False) freed the gathered parameters"
    assert all(p.detach().dim() == 1 for p in kept.parameters()), "the shards must be registered between steps"
    freed = _shard(_model())
    _grads_after_one_backward(freed, rank)
    assert all(m._fsdp_state.unit.unsharded_storage_bytes == 0 for m in (freed[0], freed[2]))
    # Training with kept copies (regathered after each optimizer step) equals the default.
    a = _shard(_model())
    b = _shard(_model())
    b.set_reshard_after_backward(False)
    _same_training(a, b)
    with pytest.raises(TypeError, match="expects a bool"):
        b.set_reshard_after_backward(0)
    return True


class _Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(torch.relu(self.lin(self.emb(tokens))))


def _shard_embedder(model):
    mfsdp.fully_shard(model.emb)
    mfsdp.fully_shard(model.lin)
    return mfsdp.fully_shard(model)


def _unshard_in_backward(rank, world):
    from megatron_fsdp_ext import _C

    reference, model = _shard_embedder(_Embedder()), _shard_embedder(_Embedder())
    model.emb.set_unshard_in_backward(False)  # an embedding's weight gradient needs only the indices
    for m in (reference, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step * 7 + rank))
            m(tokens).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, q), "training without gathering the embedding in backward differs"

    # During backward the embedding unit stays sharded (no all-gather); by default it is gathered.
    seen = {}
    for name, m in (("default", reference), ("off", model)):
        tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(99))
        emb_out = []
        handle = m.emb.register_forward_hook(lambda mod, args, out: emb_out.append(out))
        out = m(tokens)
        handle.remove()
        emb_out[0].register_hook(lambda g, name=name, m=m: seen.__setitem__(name, m.emb._fsdp_state.unit.state))
        out.float().pow(2).mean().backward()
    assert seen["off"] == _C.UnitState.SHARDED, seen
    assert seen["default"] != _C.UnitState.SHARDED, seen

    # A backward that does read the parameters is refused, not computed on garbage: autograd
    # unpacks the saved weight onto the freed (0-byte) storage and torch refuses it.
    wrong = _shard_embedder(_Embedder())
    wrong.lin.set_unshard_in_backward(False)
    with pytest.raises(RuntimeError, match="freed by reshard|out of bounds for storage of size 0"):
        wrong(torch.randint(0, 32, (4, 6))).float().pow(2).mean().backward()
    return True


@pytest.mark.parametrize("worker", [_divide_factors, _reshard_after_backward, _unshard_in_backward])
def test_fsdp2_setters_match_their_semantics(worker):
    assert run_distributed(worker, 2, timeout=120) == [True, True]


def test_fp16_reduction_scales_after_the_sum():
    assert run_distributed(_fp16_reduction_scales_after_the_sum, 4, timeout=120) == [True] * 4


@pytest.mark.parametrize("world", [2, 4])
def test_divide_factor_changed_while_accumulating_applies_at_the_reduction(world):
    assert run_distributed(_divide_factor_changed_while_accumulating, world, timeout=180) == [True] * world
