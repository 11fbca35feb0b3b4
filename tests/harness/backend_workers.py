"""Workers for backends other than NCCL and plain Gloo: torch's fake backend (one process
playing rank r of W), backends whose capabilities are overridden (the fallbacks), a
backend that refuses collectives, and mixed per-device backends."""
from __future__ import annotations

import os
import warnings
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.backends import register_backend_capabilities
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

from .workers import expect_error, shard_blocks_and_root

SIMULATED_CFG = LlamaConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, ffn_hidden=128, max_seq_len=32)


def under_capabilities(rank: int, world: int, caps: Dict, fn, *args):
    """Run fn(rank, world, *args) with backend capabilities overridden first:
    caps[(backend name, device type)] = register_backend_capabilities keyword arguments."""
    for (name, device_type), fields in caps.items():
        register_backend_capabilities(name, device_type, **fields)
    return fn(rank, world, *args)


def _counts() -> Dict[str, tuple]:
    return dict(_C.collective_counts())


def _delta(after: Dict[str, tuple], before: Dict[str, tuple]) -> Dict[str, tuple]:
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after
            if after[k] != before[k]}


def simulated_training(rank: int, world: int, opts: Dict) -> Dict:
    """Under the fake backend (this process is rank `rank` of `world`): build the model on
    meta, shard it (blocks, then the root), materialize, train three AdamW steps. Returns
    what one steady step issued (our counters), the bytes each unit gathers and reduces,
    this rank's shard sizes and the warnings raised."""
    mesh = None
    if opts.get("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", tuple(opts["hsdp"]), mesh_dim_names=("replicate", "shard"))
    if opts.get("check_collectives"):
        os.environ["MFSDP_CHECK_COLLECTIVES"] = "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            model = LlamaModel(SIMULATED_CFG)
        shard_opts = {k: opts[k] for k in ("sharding_strategy", "gather_bucket_bytes", "reduce_bucket_bytes")
                      if k in opts}
        if opts.get("bf16"):
            shard_opts["mp_policy"] = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32)
        shard_blocks_and_root(model, mesh=mesh, **shard_opts)
        mfsdp.materialize(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        states = [m._fsdp_state for m in model.modules() if "_mfsdp_state" in m.__dict__]
        steps = []
        for step in range(3):
            before = _counts()
            tokens = torch.randint(0, SIMULATED_CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
            model.loss(tokens, tokens).backward()
            opt.step()
            opt.zero_grad()
            steps.append(_delta(_counts(), before))
    shard_numels = [s.unit.sharded_flat.numel() for s in states]
    expected_numels = [s.unit.layout.segment_numels[s.unit.shard_index] for s in states]
    assert shard_numels == expected_numels, (shard_numels, expected_numels)
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
    sd = model.state_dict()
    plain = LlamaModel(SIMULATED_CFG)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    return {
        "steady_step": steps[-1],
        "gather_bytes": [s.unit.layout.total_numel * s.unit.param_dtype.itemsize for s in states],
        "reduce_bytes": [s.unit.layout.total_numel * s.unit.reduce_dtype.itemsize for s in states],
        "shard_bytes": [s.unit.layout.segment_numels[s.unit.shard_index] * s.unit.reduce_dtype.itemsize
                        for s in states],
        "units": len(states),
        # Unit::agree_on_grads: an int32 flag per parameter, all-reduced before each reduction
        # (with two more int32 per reduction: which units it reduces).
        "flag_bytes": [4 * s.unit.layout.num_params for s in states],
        "warnings": [str(w.message) for w in caught if "moves no data" in str(w.message)],
    }


def simulated_checkpoints_refused(rank: int, world: int, path: str) -> None:
    """Files written or read under the fake backend would hold this rank's shards in
    place of every other rank's: save/load and rank-0 broadcasts are refused by name."""
    model = shard_blocks_and_root(LlamaModel(SIMULATED_CFG))
    opt = torch.optim.AdamW(model.parameters())
    for call, what in ((lambda: mfsdp.save_checkpoint(path, model, opt), "save_checkpoint"),
                       (lambda: mfsdp.load_checkpoint(path, model, opt), "load_checkpoint"),
                       (lambda: mfsdp.load_full_state_dict(model, LlamaModel(SIMULATED_CFG).state_dict(),
                                                           broadcast_from_rank0=True),
                        "load_full_state_dict(broadcast_from_rank0=True)")):
        expect_error(call, RuntimeError, what, "backend 'fake' moves no data", "checkpoints need a backend")
    assert not os.path.exists(path), "a refused save left files behind"
    # Without a broadcast every rank cuts its own slice: the load is exact here too.
    full = LlamaModel(SIMULATED_CFG).state_dict()
    mfsdp.load_full_state_dict(model, full)
    state = model.blocks[0]._fsdp_state
    piece = state.unit.layout.shard_slice(0, state.unit.shard_index)
    name = state.names[0]
    want = full[f"blocks.0.{name}"].reshape(-1)[piece.param_offset: piece.param_offset + piece.numel]
    assert torch.equal(state.sharded_params[0].detach(), want), "rank's slice after a local load"


def refusing_backend_is_named(rank: int, world: int) -> None:
    """A backend that raises on a collective: the error names our collective, the
    backend, the unit and the backend's own message."""
    from torch._C._distributed_c10d import FakeProcessGroup

    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    refusing = dist.new_group(list(range(world)), backend="fake", pg_options=options)
    model = mfsdp.fully_shard(nn.Linear(4, 4), process_group=refusing)
    expect_error(lambda: model(torch.randn(2, 4)), RuntimeError, "all-gather of parameters of fully_shard unit",
                 "all_gather_flat on backend 'fake' failed", "error_on_collective=true")


def mixed_backend_devices(rank: int, world: int) -> Dict:
    """On "cpu:gloo,cuda:fake" each device type has its own capabilities; CPU units use
    Gloo's and train like one process (the parity worker runs on the default group)."""
    group = dist.group.WORLD
    cpu, cuda = _C.backend_caps(group, torch.device("cpu")), _C.backend_caps(group, torch.device("cuda"))
    assert (cpu.name, cpu.moves_data) == ("gloo", True) and (cuda.name, cuda.moves_data) == ("fake", False)
    return {"cpu": cpu.name, "cuda": cuda.name}


def dtensor_gather_matches_full_tensor(rank: int, world: int) -> int:
    """state_dict.gather_dtensor (plain collectives) equals torch's full_tensor() for
    uneven and empty chunks, any shard dim, 1-D and 2-D meshes, nested shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron_fsdp_ext.core.state_dict import gather_dtensor

    flat = init_device_mesh("cpu", (world,))
    square = init_device_mesh("cpu", (2, world // 2))
    g = torch.Generator().manual_seed(0)
    cases = [(flat, [Shard(0)], (7, 3)), (flat, [Shard(1)], (2, 5)), (flat, [Shard(0)], (2, 3)),
             (flat, [Replicate()], (3, 3)), (square, [Replicate(), Shard(0)], (5, 4)),
             (square, [Shard(0), Shard(1)], (6, 5)), (square, [Shard(0), Shard(0)], (9, 2))]
    for mesh, placements, shape in cases:
        full = torch.randn(shape, generator=g)
        d = distribute_tensor(full, mesh, placements)
        ours = gather_dtensor(d)
        assert torch.equal(ours, d.full_tensor()) and torch.equal(ours, full), (placements, shape)
    return len(cases)


def meta_shards_follow_the_backend(rank: int, world: int, expect: str) -> Optional[str]:
    """Deferred init allocates shards on a device the group communicates."""
    with torch.device("meta"):
        lin = nn.Linear(8, 8)
    mfsdp.fully_shard(lin)
    got = lin.weight.device.type
    assert got == expect, f"meta shards on {got}, expected {expect}"
    return got


def gloo_worker_threads(rank, world):
    """The worker-thread count and type of every Gloo group a rank of run_distributed
    creates: the default group, a new_group and a DeviceMesh's subgroups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    groups = {"world": dist.group.WORLD, "new_group": dist.new_group(list(range(world))),
              "mesh_rep": mesh.get_group("rep"), "mesh_shard": mesh.get_group("shard")}
    out = {}
    for name, group in groups.items():
        backend = group._get_backend(torch.device("cpu"))
        out[name] = (backend.options._threads, isinstance(backend, dist.ProcessGroupGloo))
    return out
