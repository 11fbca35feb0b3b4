"""Bad input gets a clear error naming the problem."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.testing import run_distributed


def test_process_group_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        mfsdp.fully_shard(nn.Linear(2, 2))


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_non_floating_mixed_precision_dtype(field):
    with pytest.raises(ValueError, match=f"{field} must be a floating-point dtype"):
        mfsdp.MixedPrecisionPolicy(**{field: torch.int32})
    with pytest.raises(TypeError, match=f"{field} must be a torch.dtype"):
        mfsdp.MixedPrecisionPolicy(**{field: "bf16"})


def _bad_inputs(rank, world):
    cfg = LlamaConfig(n_layers=2)

    # fully_shard twice on one module.
    m = LlamaModel(cfg)
    mfsdp.fully_shard(m.blocks[0])
    try:
        mfsdp.fully_shard(m.blocks[0])
        raise AssertionError("double fully_shard accepted")
    except ValueError as e:
        assert "already called" in str(e) and "Block" in str(e)

    # Outer unit wrapped before its inner units.
    m = LlamaModel(cfg)
    mfsdp.fully_shard(m)
    try:
        mfsdp.fully_shard(m.blocks[1])
        raise AssertionError("inner after outer accepted")
    except ValueError as e:
        assert "bottom-up" in str(e) and "attn_norm.weight" in str(e), str(e)

    # Parameters on different devices / not materialized.
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    try:
        mfsdp.fully_shard(m)
        raise AssertionError("mixed devices accepted")
    except ValueError as e:
        assert "different devices" in str(e) and "'1.weight' on meta" in str(e), str(e)
    m = nn.Linear(2, 2, device="meta")
    try:
        mfsdp.fully_shard(m)
        raise AssertionError("meta params accepted")
    except ValueError as e:
        assert "meta device" in str(e)

    # Gloo group with parameters not on CPU is covered in the GPU suite; here: wrong type.
    try:
        mfsdp.fully_shard(m, mp_policy={"param_dtype": torch.bfloat16})
        raise AssertionError("dict policy accepted")
    except TypeError as e:
        assert "MixedPrecisionPolicy" in str(e)

    # Integer parameter.
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    try:
        mfsdp.fully_shard(m)
        raise AssertionError("integer parameter accepted")
    except ValueError as e:
        assert "'w' has non-floating dtype torch.int64" in str(e)

    # Mixed dtypes inside one unit.
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    try:
        mfsdp.fully_shard(m)
        raise AssertionError("mixed dtypes accepted")
    except RuntimeError as e:
        assert "single parameter dtype" in str(e) and "1.weight" in str(e), str(e)

    # Tied parameter across two units.
    m = LlamaModel(cfg)
    m.blocks[0].mlp.w_down.weight = m.blocks[1].mlp.w_down.weight
    mfsdp.fully_shard(m.blocks[1])
    try:
        mfsdp.fully_shard(m.blocks[0])
        raise AssertionError("cross-unit tie accepted")
    except ValueError as e:
        assert "tied" in str(e) and "mlp.w_down.weight" in str(e)

    # Replacing the data of a sharded parameter with a different shape.
    m = LlamaModel(cfg)
    for b in m.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(m)
    m.blocks[0].mlp.w_down.weight.data = torch.zeros(5)
    try:
        m(torch.zeros(1, 4, dtype=torch.long))
        raise AssertionError("replaced .data accepted")
    except RuntimeError as e:
        assert "mlp.w_down.weight" in str(e) and "was replaced" in str(e), str(e)


def test_bad_inputs_world2():
    run_distributed(_bad_inputs, 2, timeout=120)
