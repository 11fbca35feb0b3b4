"""Unit.param_specs (csrc/param_spec.h) on 2 Gloo ranks: one spec per parameter, in the
unit's order, and each field agrees with an independent source: the module's own
parameters (name, shape, dtype), the policy (gather dtype and transform), the unit's
device, and the sharded parameter this rank holds (its slice). Cutting a full value with
Unit.local_piece gives exactly that sharded parameter."""
import pytest
import torch

from harness import run_distributed


def _specs_match(rank, world, param_dtype):
    import megatron_fsdp_ext as mfsdp
    from megatron_fsdp_ext import _C

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False))
    reference = {n: p.detach().clone() for n, p in net.named_parameters()}
    mfsdp.fully_shard(net, mp_policy=mfsdp.MixedPrecisionPolicy(param_dtype=param_dtype))
    state = net._fsdp_state
    unit = state.unit
    specs = unit.param_specs
    assert [s.name for s in specs] == list(reference), [s.name for s in specs]
    cast = param_dtype is not None and param_dtype != torch.float32
    assert unit.gather_transform == (_C.GatherTransform.CAST if cast else _C.GatherTransform.NONE)
    covered = 0
    for spec, shard, (name, full) in zip(specs, state.sharded_params, reference.items()):
        assert spec.shape == tuple(full.shape) and spec.numel == full.numel(), (name, spec)
        assert spec.dtype == torch.float32 and spec.gather_dtype == (param_dtype or torch.float32), spec
        assert spec.transform == unit.gather_transform and spec.storage_device == unit.device, spec
        assert spec.slice.numel == shard.detach().numel() and shard.shape == spec.shape, (spec, shard.detach().shape)
        piece = unit.local_piece(list(reference).index(name), full)
        assert torch.equal(piece, shard.detach()), name
        assert torch.equal(piece, full.reshape(-1)[spec.slice.param_offset: spec.slice.param_offset + spec.slice.numel])
        covered += spec.slice.numel
    for k, spec in enumerate(specs):  # one spec by index: the same record
        one = unit.param_spec(k)
        assert (one.name, one.shape, one.slice.param_offset, one.slice.numel) == \
            (spec.name, spec.shape, spec.slice.param_offset, spec.slice.numel)
    with pytest.raises(IndexError):
        unit.param_spec(len(specs))
    assert repr(specs[0]).startswith(f"ParamSpec('0.weight', shape=[7, 5], dtype=Float"), repr(specs[0])
    with pytest.raises(ValueError, match=r"a full value of shape \[3, 3\] \(9 elements\) for a parameter of shape"):
        unit.local_piece(0, torch.zeros(3, 3))
    return covered


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_param_specs_describe_each_parameter(param_dtype):
    covered = run_distributed(_specs_match, 2, param_dtype, timeout=120)
    # The two ranks' slices together cover every element exactly once.
    assert sum(covered) == 5 * 7 + 7 + 7 * 3
