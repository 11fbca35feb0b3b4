"""FSDP2's spelling of fully_shard's arguments: torch's MixedPrecisionPolicy and a 1-D
DeviceMesh behave exactly like our policy and process group (same losses, same
parameters, bit for bit); what is not supported raises a clear error instead of being
taken silently."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))


def _shard(model, **kwargs):
    mfsdp.fully_shard(model[0], **kwargs)
    mfsdp.fully_shard(model[2], **kwargs)
    return mfsdp.fully_shard(model, **kwargs)


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
    assert b._fsdp_state.mp_policy == ours
    _same_training(a, b)

    mesh = init_device_mesh("cpu", (world,))
    a, b = _shard(_model()), _shard(_model(), mesh=mesh, offload_policy=OffloadPolicy())
    assert dist.get_process_group_ranks(b._fsdp_state.process_group) == list(range(world))
    _same_training(a, b)

    m = _model()
    with pytest.raises(NotImplementedError, match="1-D mesh; got 2-D"):
        mfsdp.fully_shard(m, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match="either mesh or process_group"):
        mfsdp.fully_shard(m, mesh=mesh, process_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="mesh must be a"):
        mfsdp.fully_shard(m, mesh=dist.group.WORLD)
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool or None, got 2"):
        mfsdp.fully_shard(m, reshard_after_forward=2)
    with pytest.raises(NotImplementedError, match="CPU offloading"):
        mfsdp.fully_shard(m, offload_policy=CPUOffloadPolicy())
    with pytest.raises(NotImplementedError, match="shard_placement_fn"):
        mfsdp.fully_shard(m, shard_placement_fn=lambda p: None)
    with pytest.raises(NotImplementedError, match="list of modules"):
        mfsdp.fully_shard([m[0], m[2]])
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        mfsdp.fully_shard(m, mp_policy="bf16")
    assert not isinstance(m, mfsdp.FSDPModule)  # every refusal left the module untouched
    return True


def test_fsdp2_arguments(tmp_path):
    assert run_distributed(_fsdp2_arguments, 2, timeout=120) == [True, True]
