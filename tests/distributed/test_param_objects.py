"""The C++ unit is the one holder of a unit's parameter objects: what Python reads back
(Unit.sharded_params / unsharded_params, FSDPState's properties, the module's slots) are
the very nn.Parameter objects bound to it, attributes and type included, even after
Python dropped every reference of its own."""
import gc
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from harness import run_distributed
from harness.workers import TinyBlock


def _bare_unit(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    unit = _C.Unit([torch.randn(6, 4), torch.randn(5)], ["w", "b"], pg, 4, None, None,
                   _C.ShardingStrategy.OPTIM_GRADS_PARAMS)
    sharded = [nn.Parameter(v) for v in unit.sharded_views()]
    unsharded = [nn.Parameter(v) for v in unit.unsharded_views()]
    for i, (s, u) in enumerate(zip(sharded, unsharded)):
        s.marker, u.marker = ("sharded", i), ("unsharded", i)
    unit.bind_params(sharded, unsharded)
    refs = [weakref.ref(p) for p in sharded + unsharded]
    del sharded, unsharded, s, u
    gc.collect()
    for kind, read, one in (("sharded", lambda: unit.sharded_params, unit.sharded_param),
                            ("unsharded", lambda: unit.unsharded_params, unit.unsharded_param)):
        first, second = read(), read()
        assert first is not second, "each read is a new list"
        for i, p in enumerate(first):
            assert type(p) is nn.Parameter, (kind, i, type(p))
            assert p.marker == (kind, i), (kind, i, getattr(p, "marker", None))
            assert p is second[i] and p is one(i)
    objects = unit.sharded_params + unit.unsharded_params
    assert all(r() is p for r, p in zip(refs, objects)), "the unit's objects are not the ones bound"
    # Python drops them again: they live on in the unit, attributes kept.
    del objects, first, second, p
    gc.collect()
    assert all(r() is not None for r in refs), "an object bound to the unit was freed"
    assert [p.marker for p in unit.unsharded_params] == [("unsharded", 0), ("unsharded", 1)]


def test_bare_unit_keeps_its_parameter_objects():
    run_distributed(_bare_unit, 1, timeout=60)


def _sharded_model(rank, world):
    torch.manual_seed(0)
    net = nn.Sequential(TinyBlock(), TinyBlock(), nn.ReLU())
    net[0].lin.weight.tp_marker = "kept"  # a user/Megatron attribute set before fully_shard
    for b in net[:2]:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net[2])  # no parameters: no unit
    mfsdp.fully_shard(net)
    state = net[0]._fsdp_state
    assert state.sharded_params[0] is net[0].lin.weight and state.sharded_params[1] is net[0].lin.bias
    assert state.sharded_params[0] is state.unit.sharded_params[0]
    assert net[2]._fsdp_state.unit is None and net[2]._fsdp_state.sharded_params == [] \
        and net[2]._fsdp_state.unsharded_params == []
    assert net[0].lin.weight.tp_marker == "kept" and state.unsharded_params[0].tp_marker == "kept"
    state.unsharded_params[1].user_tag = "gathered bias"
    refs = [weakref.ref(p) for p in state.unsharded_params]
    gc.collect()  # nothing in Python holds the unsharded objects now
    assert all(r() is not None for r in refs)
    seen = []
    handle = net[0].lin.register_forward_pre_hook(lambda m, args: seen.append((m.weight, m.bias)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        gc.collect()
    handle.remove()
    # The module saw the unit's unsharded objects in forward, and has the sharded ones back.
    for w, b in seen:
        assert w is refs[0]() and b is refs[1]() and b.user_tag == "gathered bias" and isinstance(w, nn.Parameter)
    del seen, w, b
    gc.collect()
    assert state.unsharded_params[1].user_tag == "gathered bias"
    assert all(r() is p for r, p in zip(refs, state.unsharded_params))
    assert net[0].lin.weight is state.sharded_params[0] and net[0].lin.weight.tp_marker == "kept"
    assert net[0].lin.weight._mfsdp_owner() is state
    assert state.slots_hold.name == "SHARDED"


def test_module_shows_the_units_objects():
    run_distributed(_sharded_model, 2, timeout=120)


def _optimizer_paths(rank, world):
    """torch's optimizers choose their fused and foreach paths by parameter type: our
    sharded parameters must get the paths plain parameters get (else AdamW steps them one
    tensor at a time: slower, and rounded differently from FSDP2's)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    torch.manual_seed(0)
    net = nn.Sequential(TinyBlock(), TinyBlock())
    plain = [nn.Parameter(torch.randn(3)) for _ in range(2)]
    for b in net:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net)
    sharded = list(net.parameters())
    assert all(type(p).__name__ == "ShardedParameter" for p in sharded)
    for use_fused in (False, True):
        assert _default_to_fused_or_foreach(sharded, False, use_fused) == \
            _default_to_fused_or_foreach(plain, False, use_fused), use_fused


def test_sharded_parameters_take_torchs_fused_and_foreach_optimizer_paths():
    run_distributed(_optimizer_paths, 2, timeout=60)
