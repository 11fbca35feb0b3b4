"""torchtitan's own parallelize code running unchanged on our fully_shard: its Llama3
"debugmodel" built from its model registry, sharded by its `apply_fsdp_to_decoder` (and
tensor-parallelized by `parallelize_llama` with its ParallelDims mesh) where the one
change is the `fully_shard` those functions call: ours instead of torch's. Trained against
one plain process on the whole batch (fp32: losses, gradients, parameters).

torchtitan 0.3.0 imports triton only for one MoE kernel module; `install_triton_stub`
replaces that module (the dense Llama3 path never calls it). On CPU its flex attention has
no backward, so the debugmodel's inner attention is swapped for causal SDPA, in the
reference model too.
"""
from __future__ import annotations

import copy
import sys
import types
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.param_index import iter_states

from .tp_workers import full_of_ours, placements_of
from .workers import device_for_backend, rel_err

_TRITON_KERNELS = [
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
]
VOCAB, SEQ = 2048, 32


def install_triton_stub() -> None:
    """torchtitan.distributed.minimal_async_ep.kernels without triton: kernels that raise."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    for kernel in _TRITON_KERNELS:
        def missing(*args, _kernel=kernel, **kwargs):
            raise RuntimeError(f"{_kernel}: a triton kernel, stubbed out (triton is not installed)")
        setattr(mod, kernel, missing)
    sys.modules[name] = mod


def available() -> str:
    """'' when torchtitan imports here, else why not."""
    try:
        install_triton_stub()
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: report it)
        return f"{type(e).__name__}: {e}"
    return ""


def _debugmodel(parallelism=None):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if parallelism is not None:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model.to(device_for_backend())


def _ours_in_torchtitan():
    """Point the `fully_shard` torchtitan's fsdp module calls at ours; returns the module."""
    import torchtitan.distributed.fsdp as tt_fsdp

    tt_fsdp.fully_shard = mfsdp.fully_shard
    return tt_fsdp


def _batches(steps: int, per: int, dp_world: int):
    g = torch.Generator().manual_seed(1000)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (dp_world * per, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _loss(model, tokens, labels):
    logits = model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train_against_plain(model, ref, placements: Dict, tp_mesh, dp_index: int, dp_world: int, steps: int = 3) -> Dict:
    device = device_for_backend()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    per, worst = 2, {"loss": 0.0, "grad": 0.0}
    for step, (tokens, labels) in enumerate(_batches(steps, per, dp_world)):
        rows = slice(dp_index * per, (dp_index + 1) * per)
        loss = _loss(model, tokens[rows].to(device), labels[rows].to(device))
        loss.backward()
        ref_loss = _loss(ref, tokens.to(device), labels.to(device))
        ref_loss.backward()
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss.item())
        mean = sum(losses) / len(losses)  # equal rows per dp rank; tp ranks repeat theirs
        err = abs(mean - ref_loss.item()) / abs(ref_loss.item())
        assert err <= 1e-5, f"step {step}: loss {mean} vs one process {ref_loss.item()}"
        worst["loss"] = max(worst["loss"], err)
        ours = full_of_ours(model, "grad", placements, tp_mesh)
        for name, p in ref.named_parameters():
            e = rel_err(ours[name].reshape(p.shape), p.grad)
            assert e <= 1e-4, f"step {step}: gradient of '{name}' rel err {e:.3e}"
            worst["grad"] = max(worst["grad"], e)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    values = full_of_ours(model, "value", placements, tp_mesh)
    worst["param"] = max(rel_err(values[n].reshape(p.shape), p.detach()) for n, p in ref.named_parameters())
    assert worst["param"] <= 1e-4, f"parameters after {steps} steps: rel err {worst['param']}"
    return worst


def titan_apply_fsdp(rank: int, world: int) -> Dict:
    """torchtitan's apply_fsdp_to_decoder on a 1-D ("dp_shard",) mesh, ours swapped in: it
    shards every block, [norm, lm_head] as one unit (FSDP2's list form) and the root."""
    from torch.distributed.device_mesh import init_device_mesh

    install_triton_stub()
    tt_fsdp = _ours_in_torchtitan()
    ref = _debugmodel()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh(device_for_backend().type, (world,), mesh_dim_names=("dp_shard",))
    tt_fsdp.apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  pp_enabled=False)
    assert isinstance(model, mfsdp.FSDPModule) and isinstance(model.layers["0"], mfsdp.FSDPModule)
    assert isinstance(model.lm_head, mfsdp.FSDPModule) and model.lm_head._fsdp_state is model.norm._fsdp_state, \
        "torchtitan's [norm, lm_head] is not one unit"
    placements = placements_of(model)
    return _train_against_plain(model, ref, placements, None, rank, world)


def titan_parallelize_llama(rank: int, world: int, tp: int) -> Dict:
    """torchtitan's parallelize_llama with tensor parallelism (its partial_dtensor backend:
    DTensors on the "tp" axis of its ParallelDims mesh, sequence parallel on) and FSDP on
    the "fsdp" axis, ours swapped in."""
    install_triton_stub()
    _ours_in_torchtitan()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    # torchtitan falls back to "cuda" when it finds no accelerator; its mesh follows this.
    tt_parallel_dims.device_type = device_for_backend().type
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=tp,
                                    data_parallel_shard_degree=world // tp)
    ref = _debugmodel(parallelism)
    model = _debugmodel(parallelism)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                      parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                      dump_folder="/tmp")
    assert isinstance(model, mfsdp.FSDPModule)
    states = [s for s in iter_states(model) if s.unit is not None]
    assert any(s.tp is not None for s in states), "no unit holds tensor-parallel parameters"
    # The TP placements, from the same model parallelized by torchtitan without FSDP.
    probe = _debugmodel(parallelism)
    probe.parallelize(dims)
    placements = placements_of(probe)
    assert any(isinstance(p, DTensor) for p in probe.parameters())
    tp_mesh, fsdp_mesh = dims.get_mesh("tp"), dims.get_mesh("fsdp")
    dp_index = fsdp_mesh.get_local_rank()
    return _train_against_plain(model, ref, placements, tp_mesh, dp_index, world // tp)
