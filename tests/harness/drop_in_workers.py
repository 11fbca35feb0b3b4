"""Workers of the drop-in tests (tests/distributed/test_drop_in.py on Gloo CPU,
tests/gpu/test_drop_in_gpu.py with CUDA tensors): our modules as FSDP2's to torch's code,
torch's clip over our gradients against FSDP2's, Megatron's micro-batch controls."""
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core import fsdp2_view
from megatron_fsdp_ext.core.grad_norm import ShardedGrad

from .workers import device_for_backend, expect_error, flat_piece


def mlp():
    """A three-layer MLP, the same on every rank (test_fsdp2_api.py uses it too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))


def shard_mlp(model, **kwargs):
    """Our fully_shard on each Linear with weights, then the root."""
    mfsdp.fully_shard(model[0], **kwargs)
    mfsdp.fully_shard(model[2], **kwargs)
    return mfsdp.fully_shard(model, **kwargs)


def identity(rank, world):
    model = shard_mlp(mlp())
    for m in (model, model[0], model[2]):
        assert isinstance(m, torch_fsdp.FSDPModule) and isinstance(m, mfsdp.FSDPModule)
    assert isinstance(model[0], nn.Linear) and isinstance(model, nn.Sequential)
    assert type(model[1:3]) is nn.Sequential  # slicing builds the user's class, as FSDP2's does
    view = torch_fsdp.fully_shard.state(model)
    assert isinstance(view, fsdp2_view.Fsdp2StateView) and model._get_fsdp_state() is view
    with pytest.raises(NotImplementedError, match="FSDPState._comm_ctx: this module was sharded by megatron_fsdp_ext"):
        view._comm_ctx
    # torch's unshard handle protocol
    handle = model[0].unshard(async_op=True)
    assert isinstance(handle, torch_fsdp.UnshardHandle)
    handle.wait()
    assert model[0].weight.shape == (32, 16)
    model[0].reshard()
    assert model[0].weight.detach().dim() == 1

    # torch's own register_fsdp_forward_method drives our unit (no longer a no-op).
    class Scorer(nn.Sequential):
        def score(self, x):
            return self(x).sum(dim=-1)

    ref = mlp()
    scorer = Scorer(*mlp())
    mfsdp.fully_shard(scorer[0])
    mfsdp.fully_shard(scorer)
    torch_fsdp.register_fsdp_forward_method(scorer, "score")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(scorer.score(x), ref(x).sum(dim=-1))
    assert scorer[2].weight.detach().dim() == 1, "the root must be released after the registered method"

    for call, match in ((lambda: model.set_reduce_scatter_max_input_buffers(2), "max_input_buffers"),
                        (lambda: model.set_separate_reduce_scatter_group(True), "create_all_gather_group")):
        with pytest.raises(NotImplementedError, match=match):
            call()
    model.set_reduce_scatter_max_input_buffers(1)
    model.set_reduce_scatter_unused_params(True)
    # torch helpers that reach further into FSDP2's state refuse by name, never silently.
    with pytest.raises(NotImplementedError, match="_comm_ctx"):
        torch_fsdp.share_comm_ctx([model[0], model[2]])
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    with pytest.raises(NotImplementedError, match="sharded by megatron_fsdp_ext"):
        with FSDPMemTracker(model, torch.optim.SGD(model.parameters(), lr=0.1)):
            pass
    return True


def reset_iter_state(rank, world):
    model, ref = shard_mlp(mlp()), shard_mlp(mlp())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))

    def explode(grad):
        raise RuntimeError("boom")

    out = model(x)
    out.register_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        out.pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="root FSDP module"):
        model[0].reset_iter_state()
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert all(m._fsdp_state.unit.unsharded_storage_bytes == 0 for m in (model[0], model[2]))
    return True


# ---------------------------------------------------------------- global gradient norms

def _mesh_for(layout, world, device):
    if layout == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",)), None
    if layout == "hsdp":
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        return mesh, None
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    return mesh["dp_shard"], mesh["tp"]


def _tp_model(tp_mesh, device):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = mlp().to(device)
    if tp_mesh is not None:  # every parameter on the tp mesh: FSDP2's norm cannot stack mixed meshes
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                            "4": ColwiseParallel(output_layouts=Replicate())})
    return model


def _ours_and_fsdp2(layout, world, strategy, check_before_backward=None):
    """The same model sharded by ours (`strategy`) and by FSDP2 on `layout`'s mesh, after
    one backward on this dp rank's batch; `check_before_backward(ours)` runs first."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    device = device_for_backend()
    dp_mesh, tp_mesh = _mesh_for(layout, world, device)
    ours, theirs = _tp_model(tp_mesh, device), _tp_model(tp_mesh, device)
    for m in (ours[0], ours[2], ours):
        mfsdp.fully_shard(m, mesh=dp_mesh, sharding_strategy=strategy)
    for m in (theirs[0], theirs[2], theirs):
        fsdp2_shard(m, mesh=dp_mesh, reshard_after_forward=strategy == "optim_grads_params")
    if check_before_backward is not None:
        check_before_backward(ours)
    dp_rank = dist.get_rank(dp_mesh.get_group(dp_mesh.ndim - 1)) + (
        dp_mesh.size(-1) * dp_mesh.get_local_rank(0) if dp_mesh.ndim == 2 else 0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + dp_rank)).to(device)
    for m in (ours, theirs):
        m(x).pow(2).mean().backward()
    return dp_mesh, ours, theirs


def norms_equal_fsdp2(rank, world, layout, norm_type, strategy):
    _, ours, theirs = _ours_and_fsdp2(layout, world, strategy)
    results = {}
    for name, m in (("ours", ours), ("fsdp2", theirs)):
        params = list(m.parameters())
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if isinstance(total, torch.distributed.tensor.DTensor):
            total = total.full_tensor()
        clipped = torch.nn.utils.clip_grad_norm_(params, max_norm=0.05, norm_type=norm_type)
        if isinstance(clipped, torch.distributed.tensor.DTensor):
            clipped = clipped.full_tensor()
        results[name] = (float(total), float(clipped))
    torch.testing.assert_close(torch.tensor(results["ours"]), torch.tensor(results["fsdp2"]), rtol=1e-5, atol=0)
    # The clipped gradients: ours (pieces of flattened parameters) against FSDP2's, as full values.
    for (name, p), q in zip(theirs.named_parameters(), _full_grads(ours)):
        torch.testing.assert_close(q, p.grad.full_tensor(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    return results["ours"]


def dtensor_face(rank, world, layout, strategy, titan=True):
    """Between backward and the optimizer step our parameters and gradients are DTensors
    to FSDP2's code, each with FSDP2's mesh (dim names, ranks) and placements (the dp
    shard as FlatShard), its full value and full gradient FSDP2's; torchtitan's clip,
    unchanged (its expert-parallel path asserts DTensors and splits by mesh names),
    gives FSDP2's norm; torch's full-state-dict load lands in the window, its
    broadcast_from_rank0 load is refused there; the step makes them plain again. Before
    backward they are plain tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import Replicate, Shard

    from megatron_fsdp_ext.core.dtensor_face import FlatShard, is_dtensor, local_numel
    from megatron_fsdp_ext.core.sharded_param import ShardedParameter

    def plain_before_backward(model):
        assert not any(isinstance(p, DTensor) for p in model.parameters()), "a DTensor before backward"

    dp_mesh, ours, theirs = _ours_and_fsdp2(layout, world, strategy, plain_before_backward)
    dp_dims = range(dp_mesh.ndim)
    for (name, q), p in zip(theirs.named_parameters(), ours.parameters()):
        assert type(p) is ShardedParameter and type(p.grad).__name__ == "ShardedGrad", (name, type(p), type(p.grad))
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert not is_dtensor(p) and not is_dtensor(p.grad) and is_dtensor(q), name
        mesh = p.device_mesh
        assert mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, (name, mesh, q.device_mesh)
        assert mesh.mesh.tolist() == q.device_mesh.mesh.tolist(), (name, mesh, q.device_mesh)
        assert p.grad.device_mesh == mesh and p.grad.placements == p.placements, name
        if strategy == "no_shard":  # replicated over every dp dim; tp's placements as FSDP2's
            assert all(p.placements[d] == Replicate() for d in dp_dims), (name, p.placements)
            assert p.placements[dp_mesh.ndim:] == q.placements[dp_mesh.ndim:], (name, p.placements, q.placements)
        else:
            assert tuple(p.placements) == tuple(q.placements), (name, p.placements, q.placements)
            for d, (ours_pl, theirs_pl) in enumerate(zip(p.placements, q.placements)):
                shard_dim = d == dp_mesh.ndim - 1 and type(theirs_pl) is Shard  # FSDP2's dp rows: our pieces
                assert type(ours_pl) is (FlatShard if shard_dim else type(theirs_pl)), (name, p.placements, q.placements)
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"grad of {name}: {m}")
        kept = copy.deepcopy(p.grad)  # still this rank's piece, still a DTensor to FSDP2's code
        assert type(kept) is type(p.grad) and (local_numel(kept) == 0 or kept.data_ptr() != p.grad.data_ptr()), name
        assert torch.equal(kept.to_local(), p.grad.to_local()), name
        local = p.grad.to_local()
        assert type(local) is torch.Tensor and local.dim() == 1 and local.numel() == local_numel(p), name
        assert local.data_ptr() == p.grad.data_ptr(), name
        # Shape queries answer the parameter's shape, FSDP2's, for parameters and gradients.
        for ours_t, theirs_t in ((p, q), (p.grad, q.grad)):
            got = (ours_t.shape, ours_t.size(), ours_t.dim(), ours_t.ndim, ours_t.numel(), len(ours_t))
            want = (theirs_t.shape, theirs_t.size(), theirs_t.dim(), theirs_t.ndim, theirs_t.numel(), len(theirs_t))
            assert got == want, (name, got, want)
        with pytest.raises(NotImplementedError, match="redistribute"):
            p.redistribute(mesh, p.placements)
        with pytest.raises(AttributeError, match="fully_shard"):
            p.grad._spec
    norms = []
    dist_utils = None
    if titan:  # titan=False: the GPU machine, without torchtitan (CI runs it); torch's clip, as its non-EP path
        from torchtitan.distributed import utils as dist_utils
    for ep_enabled in (False, True):  # max_norm large: nothing scaled, the same gradients both times
        pair = [dist_utils.clip_grad_norm_(list(m.parameters()), 1e9, foreach=True, ep_enabled=ep_enabled)
                if dist_utils is not None else torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1e9, foreach=True)
                for m in (ours, theirs)]
        pair = [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in pair]
        torch.testing.assert_close(pair[0], pair[1], rtol=1e-5, atol=0)
        norms.append(pair[0])
    # torch's full-state-dict load inside the window: distribute_tensor takes FlatShard as Shard.
    doubled = {k: v * 2 for k, v in get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True)).items()}
    set_model_state_dict(ours, dict(doubled), options=StateDictOptions(full_state_dict=True))  # (it updates the dict)
    for (name, q), p in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p.full_tensor(), 2 * q.full_tensor(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # A partial load there: the keys not given reach our load hook as the parameters
    # themselves (DTensors in the window) and keep their values.
    first = next(iter(doubled))
    set_model_state_dict(ours, {first: 3 * doubled[first] / 2}, options=StateDictOptions(full_state_dict=True, strict=False))
    for (name, q), p in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p.full_tensor(), (3 if name == first else 2) * q.full_tensor(), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    # Its broadcast_from_rank0 load would write FSDP2's rows through to_local() into our
    # flat pieces: refused, on every rank (a shape error on some ranks only would hang).
    with pytest.raises(NotImplementedError, match="to_local"):
        set_model_state_dict(ours, dict(doubled),
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=True)
    seen = []  # what the optimizer reads: plain gradients (no Python dispatch per read)
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(type(p.grad) for p in ours.parameters()))
    opt.step()
    assert seen and all(t is torch.Tensor for t in seen), seen
    for p in ours.parameters():
        # the step consumed the gradients: the parameters stop presenting as DTensors, the
        # gradients stay DTensors (their norms global) until zero_grad, as FSDP2's
        assert not isinstance(p, DTensor) and isinstance(p.grad, DTensor)
    return norms


def _full_grads(model):
    """The full gradient of each parameter of our model (named_parameters order), gathered
    from the pieces (and, for a tensor-parallel parameter, from the tp shards)."""
    from megatron_fsdp_ext.core.param_index import owner_of

    out = []
    for p in model.parameters():
        state, i = owner_of(p)
        pieces = [None] * len(state.sharded_params)
        pieces[i] = p.grad
        full = state.unit.gather_full(pieces, torch.float32)[i]
        if state.tp is not None and i in state.tp.specs:
            full = state.tp.full_of_local(i, full).full_tensor()
        out.append(full)
    return out


def _one_f_one_b_order(micro_batches: int, warmup: int):
    """The 1F1B order of forwards ("F", i) and backwards ("B", i) of one pipeline stage."""
    order, f, b = [], 0, 0
    for _ in range(min(warmup, micro_batches)):
        order.append(("F", f))
        f += 1
    while b < micro_batches:
        if f < micro_batches:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def _reductions() -> int:
    from megatron_fsdp_ext import _C

    counts = _C.collective_counts()
    return sum(calls for kind, (calls, _) in counts.items() if "reduce" in kind)


def megatron_1f1b(rank, world, strategy):
    """Megatron's schedules: every micro-batch's backward under no_sync(), then
    finish_grad_sync() once per step (its finalize_model_grads); the gradients equal one
    plain process on the whole batch, and nothing is reduced before finish_grad_sync."""
    from megatron_fsdp_ext import _C

    micro_batches, per = 4, 2
    device = device_for_backend()
    ref = mlp().to(device)
    model = mfsdp.fully_shard_model(mlp().to(device), mfsdp.FSDPConfig(data_parallel_sharding_strategy=strategy),
                                    fsdp_unit_modules=[nn.Linear])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        batch = torch.randn(world, micro_batches, per, 16, generator=g).to(device)
        # the plain process: the whole global batch, the same loss normalization
        ref_loss = sum(ref(batch[r, i]).pow(2).mean() for r in range(world) for i in range(micro_batches))
        (ref_loss / (world * micro_batches)).backward()
        outputs = {}
        _C.reset_collective_counts()
        with model.no_sync():
            for kind, i in _one_f_one_b_order(micro_batches, warmup=2):
                if kind == "F":
                    outputs[i] = model(batch[rank, i]).pow(2).mean() / micro_batches
                else:
                    outputs.pop(i).backward()
        assert _reductions() == 0, "a reduction ran inside no_sync"
        assert all(p.grad is None for p in model.parameters())
        model.finish_grad_sync()
        assert _reductions() > 0
        for p in model.parameters():  # reduced over ranks unless replicated; a DTensor to FSDP2's code either way
            assert isinstance(p.grad, ShardedGrad) and isinstance(p.grad, DTensor), type(p.grad)
            assert (type(p.grad).domain is None) == (strategy == "no_shard"), type(p.grad).domain
        for (name, q), full in zip(ref.named_parameters(), _full_grads(model)):
            torch.testing.assert_close(full, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        seen = []  # the optimizer step reads plain gradients (no Python dispatch per read)
        hook = opt.register_step_pre_hook(lambda o, a, k: seen.extend(type(p.grad) for p in model.parameters()))
        opt.step()
        hook.remove()
        assert seen and all(t is torch.Tensor for t in seen), seen
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return True


def norm_patterns(rank: int, world: int) -> bool:
    """Gradient norms as FSDP2 users write them: `p.grad.norm()`, `torch.norm(p.grad, p)`
    give the full gradient's norm on every rank; a clip over our gradients and a plain
    one (an ignored parameter's, different on each rank) is refused by name, as FSDP2
    refuses mixing DTensors and tensors, and the same clip without it still works."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))
    net = copy.deepcopy(plain)
    ignored = {net[4].bias}
    mfsdp.fully_shard(net[0])
    mfsdp.fully_shard(net[2])
    mfsdp.fully_shard(net, ignored_params=ignored)
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1))
    net(x[4 * rank:4 * rank + 4]).square().mean().backward()
    plain(x).square().mean().backward()
    for (name, p), (_, ref) in zip(net.named_parameters(), plain.named_parameters()):
        if p in ignored:
            continue
        for got, want in ((p.grad.norm(), ref.grad.norm()), (torch.norm(p.grad), torch.norm(ref.grad)),
                          (p.grad.norm(1), ref.grad.norm(1)), (p.grad.norm(float("inf")), ref.grad.norm(float("inf")))):
            torch.testing.assert_close(float(got), float(want), rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"norm of {name}'s gradient: {m}")
    # Shown, a norm not yet reduced says so (no collective: a print on one rank must not
    # wait); a format spec is refused, as FSDP2's partial DTensor refuses it.
    n = net[0].weight.grad.norm()
    assert "this rank's part" in repr(n) and "this rank's part" in str(n), repr(n)
    expect_error(lambda: f"{n:.3f}", TypeError, "call .item() (or float()) on every rank")
    assert f"{float(n):.4f}" == f"{float(plain[0].weight.grad.norm()):.4f}"
    for foreach in (True, False):
        expect_error(lambda: torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=foreach),
                     RuntimeError, "mixes fully_shard gradients with plain tensors")
    sharded = [p for p in net.parameters() if p not in ignored]
    expect_error(lambda: torch._foreach_norm([sharded[0].grad, net[4].bias.grad]), RuntimeError,
                 "mixes fully_shard gradients with plain tensors")
    total = torch.nn.utils.clip_grad_norm_(sharded, 1e9)
    want = torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p is not plain[4].bias], 1e9)
    torch.testing.assert_close(float(total), float(want), rtol=1e-5, atol=1e-7)
    return True


def shape_choices(rank: int, world: int) -> bool:
    """Code that decides by a parameter's shape after fully_shard sees the parameter, as
    FSDP2's DTensors show it: nanoGPT's weight-decay groups (`p.dim() >= 2`) and Megatron's
    no-decay rule (`len(p.shape) == 1`) train exactly as plain PyTorch with the same rule,
    gradients and parameters compared every step; nn.init's fan-in is the parameter's;
    parameter counts are the model's; printing shows the shape and this rank's piece;
    code that shapes the piece by the reported shape fails loudly."""
    from megatron_fsdp_ext.core.dtensor_face import local_numel, local_shape

    device = device_for_backend()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 3)).to(device)
    count = sum(p.numel() for p in plain.parameters())
    rules = {"nanoGPT": lambda p: p.dim() >= 2, "Megatron": lambda p: len(p.shape) != 1}
    for rule, decays in rules.items():
        ref, net = copy.deepcopy(plain), copy.deepcopy(plain)
        mfsdp.fully_shard(net[0])
        mfsdp.fully_shard(net[3])
        mfsdp.fully_shard(net)
        assert sum(p.numel() for p in net.parameters()) == count, rule
        pieces = torch.tensor([sum(local_numel(p) for p in net.parameters())], device=device)
        dist.all_reduce(pieces)
        assert int(pieces) == count, "the pieces must still be this rank's share"

        def groups(model):
            params = list(model.parameters())
            return [{"params": [p for p in params if decays(p)], "weight_decay": 0.5},
                    {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]

        ours, theirs = torch.optim.AdamW(groups(net), lr=0.1), torch.optim.AdamW(groups(ref), lr=0.1)
        assert [len(g["params"]) for g in ours.param_groups] == [2, 4], (rule, ours.param_groups)
        for step in range(3):
            x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(10 + step)).to(device)
            net(x[4 * rank:4 * rank + 4]).square().mean().backward()
            ref(x).square().mean().backward()
            for (name, p), q in zip(net.named_parameters(), ref.parameters()):
                assert p.grad.shape == q.grad.shape and p.grad.dim() == q.grad.dim(), (rule, name)
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, name=name: f"{rule}, step {step}, grad of {name}: {m}")
            ours.step()
            theirs.step()
            ours.zero_grad()
            theirs.zero_grad()
        state = net.state_dict()
        for name, q in ref.named_parameters():
            torch.testing.assert_close(state[name].full_tensor(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{rule}, {name}: {m}")

    # nn.init reads the fan-in from the shape: the parameter's (64), not the piece's (on a
    # 1-D piece it refuses: "fewer than 2 dimensions"). The unit sees the in-place write.
    lin = mfsdp.fully_shard(nn.Linear(64, 32).to(device))
    w = lin.weight
    assert (w.shape, w.size(), w.size(-1), w.dim(), w.ndim, w.numel(), len(w)) == \
        ((32, 64), (32, 64), 64, 2, 2, 2048, 32)
    assert len(local_shape(w)) == 1 and (world == 1 or local_shape(w)[0] < 2048), local_shape(w)
    torch.manual_seed(rank)
    with torch.no_grad():
        nn.init.kaiming_uniform_(w, a=5 ** 0.5)  # bound sqrt(1 / fan_in) = 1/8
    full, bias = w.full_tensor(), lin.bias.full_tensor()
    assert 0.12 < float(full.abs().max()) <= 0.125, float(full.abs().max())
    x = torch.randn(2, 64, device=device)
    torch.testing.assert_close(lin(x), x @ full.T + bias)
    lin.reshard()
    with pytest.raises(IndexError, match="Dimension out of range"):
        w.size(2)
    # Initializers that write a whole matrix into the tensor refuse on every rank (eye_
    # would resize the piece over its neighbours through out=); iterating is refused.
    for init in (nn.init.eye_, nn.init.orthogonal_, lambda t: nn.init.sparse_(t, 0.5)):
        with pytest.raises(ValueError, match="dimensions"):
            init(w)
    with pytest.raises(TypeError, match="iterating over a fully_shard"):
        list(w)
    # A product of two sharded parameters is of their full values on every rank (PEFT's
    # merge: lora_B.weight @ lora_A.weight), in each spelling; with a plain tensor it
    # would be of the piece (a dot product of two 1-D pieces, or a wrong length): refused
    # on every rank, whichever side the piece is on.
    down = mfsdp.fully_shard(nn.Linear(32, 4, bias=False).to(device))
    expected = down.weight.full_tensor() @ full
    with torch.no_grad():
        for product in (lambda: down.weight @ w, lambda: down.weight.matmul(w), lambda: down.weight.mm(w),
                        lambda: down.weight.float() @ w.float(), lambda: down.weight.double() @ w.double()):
            torch.testing.assert_close(product(), expected, check_dtype=False)
        assert w.float() is w  # a cast to its own dtype is the parameter, as torch's
        piece = w.double()  # this rank's piece in the dtype, a plain tensor to other ops
        assert piece.shape == local_shape(w) and float(piece.sum()) == float(w.detach().double().sum())
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        w @ down.weight  # (32, 64) @ (4, 32): the full shapes decide, alike on every rank
    for product in (lambda: torch.ones(4, 32, device=device) @ w, lambda: w @ torch.ones(64, 2, device=device),
                    lambda: w.float() @ torch.ones(64, 2, device=device), lambda: torch.ones(1) @ w.half(),
                    lambda: w.matmul(torch.ones(64, device=device)), lambda: w.mm(torch.ones(64, 2, device=device))):
        with pytest.raises(RuntimeError, match="matrix product with a fully_shard"):
            product()
    with pytest.raises(RuntimeError, match="backward through a matrix product of two fully_shard"):
        (down.weight @ w).sum().backward()
    # Assigning a value of the parameter's shape to .data sets the parameter on every
    # rank, whatever piece each holds (at world 2 the (3, 4) weight below is all on one
    # rank and the bias all on the other).
    tiny = mfsdp.fully_shard(nn.Linear(4, 3).to(device))
    tiny.weight.data = torch.zeros(tiny.weight.shape, device=device)
    tiny.bias.data = torch.full(tiny.bias.shape, 3.0, device=device)
    torch.testing.assert_close(tiny(torch.randn(2, 4, device=device)), torch.full((2, 3), 3.0, device=device))
    tiny.reshard()
    tiny(torch.randn(2, 4, device=device)).sum().backward()
    b = tiny.bias.grad
    # Ops of a 1-D gradient with tensors shaped like its piece run on every rank.
    b.add_(tiny.bias.detach(), alpha=0.1)
    torch.zeros_like(b).add_(b)
    b[torch.isnan(b)] = 0
    tiny.weight.grad.add_(tiny.weight.detach(), alpha=0.1)
    if device.type == "cuda":  # what CuPy / Numba read: the piece's memory, not the reported shape
        g = tiny.weight.grad
        cai = g.__cuda_array_interface__
        assert cai["shape"] == tuple(local_shape(g)), cai
        assert cai["data"][0] == (g.data_ptr() if local_numel(g) else 0), cai
        with pytest.raises(RuntimeError, match="requires grad"):
            tiny.weight.__cuda_array_interface__
    # Printing shows what it is, piece and shape; shaping the piece by the shape is loud.
    assert "shape=(32, 64)" in repr(w) and "this rank's piece" in str(w), repr(w)
    if world > 1:
        with pytest.raises(RuntimeError):
            w.view(w.shape)
    lin(x).sum().backward()
    assert "shape=(32, 64)" in repr(lin.weight.grad) and lin.weight.grad.shape == (32, 64)

    # A tensor built from the reported shape meeting the piece is refused on every rank,
    # also where broadcasting would let it through silently: a (2, 64) weight over two
    # ranks is 64 elements a rank, which `+=` would add to both rows.
    row = mfsdp.fully_shard(nn.Linear(64, 2, bias=False).to(device))
    row(torch.randn(3, 64, device=device)).sum().backward()
    g = row.weight.grad
    if world == 2:
        assert local_shape(g) == (64,), local_shape(g)
    acc = torch.zeros(g.shape, device=device)
    with pytest.raises(RuntimeError, match="holds this rank's 1-D piece"):
        acc += g
    with pytest.raises(RuntimeError, match="holds this rank's 1-D piece"):
        g.full_tensor() - g
    assert not acc.any(), "a refused op must not have written"
    kept = torch.zeros_like(g)
    kept += g  # tensors built from the gradient itself are its piece (a DTensor's stay DTensors)
    assert isinstance(kept, DTensor) and kept.shape == g.shape, (type(kept), kept.shape)
    g.mul_(torch.tensor(0.5, device=device))  # scalars meet gradients freely
    torch.testing.assert_close((g * 2).to_local(), kept.to_local())  # g * 2 is a piece of the gradient too
    return True


def compiled_optimizer_step(rank: int, world: int, backend: str) -> bool:
    """torch.compile of the optimizer's step over sharded parameters, which report their
    parameters' shapes to eager code: Dynamo traces the pieces as they are (their real
    shapes and strides), trains as plain PyTorch (AdamW with weight decay), and compiles
    no new graph after the first steps."""
    from torch._dynamo.utils import counters

    device = device_for_backend()
    torch._dynamo.reset()
    counters.clear()
    ref, model = mlp().to(device), mlp().to(device)
    shard_mlp(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    step = torch.compile(opt.step, backend=backend)
    per = 8 // world
    graphs = []
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(device)
        ref(x).pow(2).mean().backward()
        model(x[rank * per:(rank + 1) * per]).pow(2).mean().backward()
        ref_opt.step()
        step()
        ref_opt.zero_grad()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        # Inductor fuses AdamW differently and CUDA reduces a split batch in another order:
        # a wrong or missed step moves parameters by about lr (1e-2).
        torch.testing.assert_close(full[k].to(device), v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[-2], f"the compiled step recompiled every step: {graphs}"
    assert model[4].weight.shape == (4, 16), "eager code sees the parameter's shape"
    return True


def norm_orders(rank: int, world: int) -> bool:
    """Every norm order torch takes, over gradients some ranks hold none of: per parameter,
    torch's get_total_norm and clip, and ours, equal plain PyTorch's on every rank; -inf
    (a min: an empty piece must not count as 0) and 0 (the count of nonzero gradients)
    included. A NaN in one rank's piece makes the inf- and 2-norm NaN on every rank (a
    backend's MAX may drop another rank's NaN), so error_if_nonfinite raises everywhere.
    Norms taken after optimizer.step() are still global (the step pre-hook's plain types
    are undone after it)."""
    U = torch.nn.utils
    device = device_for_backend()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3)).to(device)
    net = copy.deepcopy(plain)
    mfsdp.fully_shard(net[2])  # 70 elements: at world 4 some ranks hold none of the bias
    mfsdp.fully_shard(net)
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(1)).to(device)
    # On GPUs the half batches meet other kernels than the whole batch (a min of |g| is small).
    tol = dict(rtol=1e-4, atol=1e-7) if device.type == "cuda" else dict(rtol=1e-5, atol=1e-9)

    def backward():
        for m in (net, plain):
            m.zero_grad(set_to_none=True)
        net(x[4 * rank:4 * rank + 4]).square().mean().backward()
        plain(x).square().mean().backward()

    def close(got, want, what):
        torch.testing.assert_close(float(got), float(want), **tol, msg=lambda m: f"{what}: {m}")

    backward()
    for ord in (2.0, 1.0, 3.0, 0.5, -1.0, math.inf, -math.inf, 0.0):
        for (name, p), q in zip(net.named_parameters(), plain.parameters()):
            close(torch.linalg.vector_norm(p.grad, ord), torch.linalg.vector_norm(q.grad, ord), f"ord {ord}, {name}")
        for foreach in (True, False):
            close(U.get_total_norm([p.grad for p in net.parameters()], ord, foreach=foreach),
                  U.get_total_norm([q.grad for q in plain.parameters()], ord, foreach=foreach),
                  f"get_total_norm(ord {ord}, foreach={foreach})")
        want = U.clip_grad_norm_(plain.parameters(), 1e9, ord)
        close(U.clip_grad_norm_(net.parameters(), 1e9, ord), want, f"torch's clip, ord {ord}")
        close(mfsdp.clip_grad_norm_(net, 1e9, ord), want, f"our clip, ord {ord}")

    # A NaN in the piece of one gradient held by the last rank that holds any of it.
    holder = torch.tensor([rank if net[0].weight.detach().numel() > 0 else -1], device=device)
    dist.all_reduce(holder, op=dist.ReduceOp.MAX)
    assert holder.item() > 0, "the NaN must sit on a rank other than the first"
    for ord in (math.inf, 2.0):
        for clip in (U.clip_grad_norm_, mfsdp.clip_grad_norm_):
            backward()
            grad = net[0].weight.grad
            if rank == holder.item():
                with torch.no_grad():
                    flat_piece(grad)[0] = math.nan
            expect_error(lambda: clip(net.parameters(), 1.0, ord, error_if_nonfinite=True), RuntimeError,
                         "non-finite")

    # After the step.
    backward()
    for model in (net, plain):
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    close(U.get_total_norm([p.grad for p in net.parameters()]), U.get_total_norm([q.grad for q in plain.parameters()]),
          "get_total_norm after the step")
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):
        close(p.grad.norm(), q.grad.norm(), f"{name}'s gradient norm after the step")
    return True


def long_piece_norms(rank: int, world: int) -> bool:
    """Norms of gradient pieces longer than torch's CPU norm kernel sums accurately (one
    running fp32 sum: a 1.6M-element norm comes out ~6e-5 low): torch's clip,
    get_total_norm and a single gradient's vector_norm, in orders 2, 1 and 3, are within
    2e-6 of the fp64 norm of the full gradients on every rank; inf exactly."""
    U = torch.nn.utils
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2048, 1536), nn.Tanh(), nn.Linear(1536, 8))  # 3.2M elements in one unit
    mfsdp.fully_shard(net)
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(rank))
    net(x).square().mean().backward()
    grads = [p.grad.full_tensor().reshape(-1).double() for p in net.parameters()]  # net[0].weight's first
    full = torch.cat(grads)
    for ord in (2.0, 1.0, 3.0, math.inf):
        want, want_weight = (torch.linalg.vector_norm(g, ord).item() for g in (full, grads[0]))
        tol = 0.0 if ord == math.inf else 2e-6
        for what, got, expected in (
                ("clip", U.clip_grad_norm_(net.parameters(), 1e9, ord), want),
                ("get_total_norm", U.get_total_norm([p.grad for p in net.parameters()], ord), want),
                ("vector_norm", torch.linalg.vector_norm(net[0].weight.grad, ord), want_weight)):
            err = abs(float(got) - expected) / expected
            assert err <= tol, f"{what}, ord {ord}: {float(got)!r} against fp64 {expected!r} ({err:.2e} relative)"
    return True


def casts_and_piece_operands(rank: int, world: int) -> bool:
    """Casts of sharded parameters keep torch's meaning: a cast to the parameter's own
    dtype is the parameter, and a product of casts is of the casts' own values (a copy,
    written since, or its parameter written since). Another parameter's piece scaled by a
    number is that parameter's full value to `.data`'s in-place ops; a plain tensor made
    from it is not, and fails on every rank alike (at world 2 below each vector is whole on
    one rank and empty on the other), never taken for a full value on one."""
    device = device_for_backend()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, 3, bias=False), nn.Linear(3, 5, bias=False)).to(device, torch.bfloat16)
    model = copy.deepcopy(ref)
    for layer in model:
        mfsdp.fully_shard(layer)
    mfsdp.fully_shard(model)
    with torch.no_grad():
        a, b = model[0].weight.float(), model[1].weight.float()
        ra, rb = ref[0].weight.float(), ref[1].weight.float()
        a.mul_(3)
        ra.mul_(3)
        model[1].weight.data.mul_(2)  # after the cast: not in it
        ref[1].weight.mul_(2)
        torch.testing.assert_close(b @ a, rb @ ra, rtol=0, atol=0)
    fp32 = mfsdp.fully_shard(nn.Linear(3, 4).to(device))
    assert fp32.weight.float() is fp32.weight and tuple(fp32.weight.float().shape) == (4, 3)

    class Vectors(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, device=device))
            self.v = nn.Parameter(torch.randn(8, device=device))

    torch.manual_seed(1)
    vectors = mfsdp.fully_shard(Vectors())
    w, v = vectors.w.full_tensor(), vectors.v.full_tensor()
    # Another parameter scaled by a number keeps its parameter (PEFT's lora_bias merge):
    # its full value, of which w takes its part.
    with torch.no_grad():
        vectors.w.data += vectors.v * 2
        vectors.w.data -= 0.5 * -vectors.v / 4
    torch.testing.assert_close(vectors.w.full_tensor(), w + 2 * v + v / 8)
    # Operators between two parameters laid out differently (PEFT's safe merge of a LoRA
    # bias: `bias + lora_B.bias * scaling`, assigned to the bias's `.data`): the other's
    # values where this piece lies; the result keeps this piece's layout.
    w, v = vectors.w.full_tensor(), vectors.v.full_tensor()
    with torch.no_grad():
        s = vectors.w + vectors.v * 2 - vectors.v.data / 4
        t = 1 - vectors.v + vectors.w - vectors.w.float() * vectors.v
        vectors.w.data = s
        vectors.v.data.copy_(t)
    torch.testing.assert_close(vectors.w.full_tensor(), w + 2 * v - v / 4)
    torch.testing.assert_close(vectors.v.full_tensor(), 1 - v + w - w * v)
    raised = 0
    try:  # a plain tensor made from v's piece: elementwise, which fails on every rank here
        with torch.no_grad():
            vectors.w.data += vectors.v.detach() * 2
    except RuntimeError:
        raised = 1
    counts = torch.tensor([raised], device=device)
    dist.all_reduce(counts)
    assert int(counts) == world, f"{int(counts)} of {world} ranks raised"
    # Rows of a parameter meet another's marked piece the same way.
    lin = mfsdp.fully_shard(nn.Linear(4, 3, bias=False).to(device))
    other = mfsdp.fully_shard(nn.Linear(4, 3, bias=False).to(device))
    a, b = lin.weight.full_tensor(), other.weight.full_tensor()
    with torch.no_grad():
        lin.weight.data[...] += other.weight * 3
    torch.testing.assert_close(lin.weight.full_tensor(), a + 3 * b)
    # Two parameters laid out alike meet piece for piece, with no collective (an EMA of a
    # model sharded as its twin: `e.data.copy_(e.data * d + p.data * (1 - d))`).
    from megatron_fsdp_ext import _C

    a, b = lin.weight.full_tensor(), other.weight.full_tensor()
    before = dict(_C.collective_counts())
    with torch.no_grad():
        lin.weight.data.copy_(lin.weight.data * 0.75 + other.weight.data * 0.25 - other.weight / 8)
    assert dict(_C.collective_counts()) == before, (before, dict(_C.collective_counts()))
    torch.testing.assert_close(lin.weight.full_tensor(), a * 0.75 + b / 8)
    # A copy of `.data` is laid out as it is (PEFT's safe merge: the full delta added to a
    # clone, checked, then assigned back); until then the parameter keeps its values.
    a, delta = lin.weight.full_tensor(), torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        merged = lin.weight.data.clone()
        merged += delta
        torch.testing.assert_close(lin.weight.full_tensor(), a)
        lin.weight.data = merged
    torch.testing.assert_close(lin.weight.full_tensor(), a + delta)
    return True


def reference_model_sync(rank: int, world: int) -> bool:
    """TRL's sync of a reference model into the policy's values (SyncRefModelCallback:
    `ref.data.mul_(1 - a).add_(policy.data, alpha=a)` per parameter) with the reference
    sharded as one unit and the policy per layer: the pieces lie differently, and the
    policy's `.data` counts as its full value (gathered); equal to one process. Laid out
    alike, the update stays elementwise: no collective."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()
    torch.manual_seed(0)
    plain_policy = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3), nn.LayerNorm(3)).to(device)
    torch.manual_seed(1)
    plain_ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3), nn.LayerNorm(3)).to(device)
    policy, ref, twin = copy.deepcopy(plain_policy), copy.deepcopy(plain_ref), copy.deepcopy(plain_ref)
    for layer in policy[:2]:
        mfsdp.fully_shard(layer)
    mfsdp.fully_shard(policy)
    mfsdp.fully_shard(ref)  # one unit, as TRL's prepare_fsdp shards the reference model
    for layer in twin[:2]:
        mfsdp.fully_shard(layer)
    mfsdp.fully_shard(twin)
    alpha = 0.3
    with torch.no_grad():
        for r, p in zip(plain_ref.parameters(), plain_policy.parameters()):
            r.mul_(1 - alpha).add_(p, alpha=alpha)
        for r, p in zip(ref.parameters(), policy.parameters()):
            r.data.mul_(1 - alpha).add_(p.data, alpha=alpha)
        before = dict(_C.collective_counts())
        for r, p in zip(twin.parameters(), policy.parameters()):
            r.data.mul_(1 - alpha).add_(p.data, alpha=alpha)
        after = dict(_C.collective_counts())
    assert after == before, (before, after)
    for model in (ref, twin):
        full = mfsdp.full_state_dict(model, rank0_only=False)
        for k, v in plain_ref.state_dict().items():
            torch.testing.assert_close(full[k].to(device), v, msg=lambda m: f"{k}: {m}")
    return True


def ema_and_vectors_across_layouts(rank: int, world: int) -> dict:
    """An EMA of a model trained per layer, kept in a copy sharded as one unit (its pieces
    lie elsewhere than the trained model's on every rank), updated in the spellings EMA code
    uses; and torch's parameters_to_vector / vector_to_parameters of the parameters and of
    the gradients. Against one plain process doing the same: worst absolute error per check."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    device = device_for_backend()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(device)
    spellings = ["lerp_", "mul_add_", "data_lerp_", "copy_of_operators", "isub_"]
    ref_emas = {s: copy.deepcopy(ref) for s in spellings}
    model = copy.deepcopy(ref)
    for layer in model:
        if isinstance(layer, nn.Linear):
            mfsdp.fully_shard(layer)
    mfsdp.fully_shard(model)
    emas = {s: mfsdp.fully_shard(copy.deepcopy(ref)) for s in spellings}  # one unit each
    worst = {}

    def note(key, got, want):
        worst[key] = max(worst.get(key, 0.0), float((got - want).abs().max()))

    def update(ema, source, d, spelling):
        with torch.no_grad():
            for e, p in zip(ema.parameters(), source.parameters()):
                if spelling == "lerp_":
                    e.lerp_(p, 1 - d)
                elif spelling == "mul_add_":
                    e.mul_(d).add_(p, alpha=1 - d)
                elif spelling == "data_lerp_":
                    e.data.lerp_(p.data, 1 - d)
                elif spelling == "copy_of_operators":
                    e.copy_(e * d + p * (1 - d))
                else:
                    e -= (1 - d) * (e - p)

    # The EMA starts as the trained model's values, copied parameter by parameter.
    with torch.no_grad():
        for s in spellings:
            for e, p in zip(ref_emas[s].parameters(), ref.parameters()):
                e.copy_(p)
            for e, p in zip(emas[s].parameters(), model.parameters()):
                e.copy_(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 6, generator=g).to(device)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        note("grad_vector", parameters_to_vector([p.grad for p in model.parameters()]),
             parameters_to_vector([p.grad for p in ref.parameters()]))
        note("grad_vector_norm", parameters_to_vector([p.grad for p in model.parameters()]).norm(),
             parameters_to_vector([p.grad for p in ref.parameters()]).norm())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():
            note("param_vector", parameters_to_vector(model.parameters()), parameters_to_vector(ref.parameters()))
        for s in spellings:
            update(emas[s], model, 0.8, s)
            update(ref_emas[s], ref, 0.8, s)
            for e, r in zip(emas[s].parameters(), ref_emas[s].parameters()):
                note(f"ema_{s}", e.full_tensor(), r)
    # A vector of the whole model written back, as a line search or a weight sync does:
    # torch's vector_to_parameters is refused by name on every rank (its view_as sees the
    # piece), before it writes anything; the full-value spelling it names does the same.
    with torch.no_grad():
        vector = parameters_to_vector(model.parameters()) * 0.5 + 1
        if world > 1:
            expect_error(lambda: vector_to_parameters(vector, model.parameters()), NotImplementedError,
                         "vector_to_parameters", "p.data = vec")
        else:  # one rank: every piece is its whole parameter, and torch's function works
            vector_to_parameters(vector + 0, model.parameters())
        i = 0
        for p in model.parameters():
            p.data = vector[i:i + p.numel()].view(p.shape)
            i += p.numel()
        vector_to_parameters(parameters_to_vector(ref.parameters()) * 0.5 + 1, ref.parameters())
    for p, r in zip(model.parameters(), ref.parameters()):
        note("vector_to_parameters", p.full_tensor(), r)
    return worst


def prune_and_parametrize_refused(rank: int, world: int) -> bool:
    """torch.nn.utils.prune and torch.nn.utils.parametrize on a module inside a unit are
    refused by name on every rank before they move anything (before: prune's mask was of
    piece elements, one rank failed in topk and the others hung at the next gather), the
    model keeps training as one plain process does; a parameter deleted from its module is
    refused by name at the next forward."""
    from torch.nn.utils import parametrize, prune

    device = device_for_backend()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).to(device)
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):
        mfsdp.fully_shard(layer)
    mfsdp.fully_shard(model)
    expect_error(lambda: prune.l1_unstructured(model[0], "weight", amount=0.3), NotImplementedError,
                 "parameter 'weight'", "as 'weight_orig'", "torch.nn.utils.prune")
    expect_error(lambda: parametrize.register_parametrization(model[2], "weight", nn.Identity()),
                 NotImplementedError, "parameter 'weight'", "as 'original'", "ParametrizationList")
    assert set(model[0]._parameters) == {"weight", "bias"} and not parametrize.is_parametrized(model[2])
    # Assigning a parameter to its own slot again passes.
    model[0].weight = model[0].weight
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)).to(device)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)
    del model[2].bias
    expect_error(lambda: model(x), ValueError, "parameter 'bias'", "removed from its module")
    return True
