"""A Megatron-style configuration and entry point, so that a Megatron training script
switches to megatron_fsdp_ext in a few lines:

    config = FSDPConfig(data_parallel_sharding_strategy="optim_grads_params",
                        grad_reduce_in_fp32=True, bf16=True)
    model = fully_shard_model(model, config, fsdp_unit_modules=[TransformerLayer])
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    attach_param_sync(optimizer, model)   # fsdp_all_gather_in_start_param_sync

Field names follow Megatron-LM's DistributedDataParallelConfig / Megatron-FSDP.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.api import fully_shard
from ..core.options import MixedPrecisionPolicy, as_timeout, check_offload_fraction, offloaded_units
from ..core.strategy import SHARDING_STRATEGIES, sharding_strategy
from ..core.dtensor_face import is_dtensor


@dataclass
class FSDPConfig:
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """"no_shard", "optim" (ZeRO-1), "optim_grads" (ZeRO-2) or "optim_grads_params" (ZeRO-3)."""

    overlap_grad_reduce: bool = True
    """Reduce each unit's gradients on the reduce-scatter stream while earlier units'
    backward computes. False: backward waits for every reduction as it is issued."""

    overlap_param_gather: bool = True
    """All-gather the next unit's parameters while the current one computes (prefetch
    depth 1). False: each unit gathers when it is reached."""

    fsdp_all_gather_in_start_param_sync: bool = True
    """start_param_sync() (e.g. attach_param_sync(optimizer, model)) launches the first
    all-gathers right after the optimizer step. Turn off to keep every collective inside
    forward/backward (CUDA-graph capture of a whole step)."""

    create_all_gather_group: Optional[bool] = None
    """Give all-gathers their own communicator so they overlap reduce-scatters
    (None: on for NCCL)."""

    bucket_size: Optional[int] = None
    """Only used when no fsdp_unit_modules are given: modules are grouped into units of
    at least this many parameter elements (a size-based wrap, bottom-up). None: one unit
    for the whole model."""

    grad_reduce_in_fp32: bool = False
    """Reduce gradients in fp32 even when parameters are gathered in bf16/fp16."""

    bf16: bool = False
    """Gather parameters and compute in bfloat16 (fp32 shards stay the master copy)."""

    fp16: bool = False
    """Gather parameters and compute in float16."""

    check_for_nan_in_grad: bool = False
    """Megatron's: a NaN or Inf in a reduced gradient stops optimizer.step() (and
    clip_grad_norm_) on every rank with NonFiniteGradientError naming the rank, unit and
    parameter (fully_shard(check_for_nan_in_grad=True))."""

    collective_timeout: Optional[Union[float, datetime.timedelta]] = None
    """Seconds (or a timedelta) any FSDP collective may wait before failing with an error
    naming the unit and phase (fully_shard(timeout=...)); None: the process group's timeout."""

    outer_dp_sharding_strategy: str = "no_shard"
    """Hybrid sharding (a device mesh with dp_outer_dim): what is sharded across the outer
    (replicate) dimension. "no_shard": replicas hold the same shards and all-reduce
    gradient shards (HSDP); "optim" (outer optimizer sharding) is not supported yet."""

    optimizer_cpu_offload: bool = False
    """Megatron's --optimizer-cpu-offload: keep shards (fp32 master weights), their gradients
    and the optimizer state in host memory (fully_shard(offload_policy=CPUOffloadPolicy())),
    stepped by megatron_fsdp_ext.optim.CPUAdamW or any torch optimizer."""

    optimizer_offload_fraction: float = 1.0
    """Megatron's --optimizer-offload-fraction: with optimizer_cpu_offload, offload whole
    units, inner ones first, until this fraction of the parameters is offloaded
    (options.offloaded_units); the rest stay on the device."""

    offload_pin_memory: bool = True
    """Pin offloaded host memory, so that copies to and from the device are asynchronous."""

    nccl_ub: bool = False
    """Megatron-FSDP's NCCL user buffers: every unit's all-gather output and reduce-scatter
    input are allocated by the process group (NCCL: ncclMemAlloc, registered with the
    communicator), as set_allocate_memory_from_process_group_for_comm(True) on each unit.
    Where the backend cannot allocate (Gloo) the caching allocator stays, with a warning."""

    def __post_init__(self):
        sharding_strategy(self.data_parallel_sharding_strategy)
        check_offload_fraction(self.optimizer_offload_fraction, "FSDPConfig.optimizer_offload_fraction: ")
        if self.outer_dp_sharding_strategy == "optim":
            raise NotImplementedError(
                "FSDPConfig.outer_dp_sharding_strategy='optim' (optimizer state sharded across the outer "
                "data-parallel dimension too) is not supported yet; use 'no_shard' (plain HSDP)")
        if self.outer_dp_sharding_strategy != "no_shard":
            raise ValueError(f"FSDPConfig.outer_dp_sharding_strategy must be 'no_shard' or 'optim', "
                             f"got {self.outer_dp_sharding_strategy!r}")
        if not isinstance(self.nccl_ub, bool):
            raise TypeError(f"FSDPConfig.nccl_ub must be a bool, got {self.nccl_ub!r}")
        if self.bf16 and self.fp16:
            raise ValueError("FSDPConfig: bf16 and fp16 are exclusive; pick one")
        try:
            as_timeout(self.collective_timeout)  # the rule fully_shard(timeout=...) applies
        except ValueError as e:
            raise ValueError(f"FSDPConfig.collective_timeout: {e}") from None
        if self.bucket_size is not None and (not isinstance(self.bucket_size, int) or self.bucket_size < 1):
            raise ValueError(f"FSDPConfig.bucket_size must be a positive int (elements) or None, got {self.bucket_size!r}")

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        param_dtype = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else None
        # fp32 reduction whenever asked: also for a model whose parameters are bf16 already.
        reduce_dtype = torch.float32 if self.grad_reduce_in_fp32 else None
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _runs_forward(mod: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict, ...) are never called: their hooks would not
    run, so they cannot be units."""
    return type(mod).forward is not nn.Module.forward


def _size_based_units(module: nn.Module, min_numel: int, ignored: set) -> list:
    """Bottom-up: a child becomes a unit once the parameters it holds that no unit
    below it took reach min_numel (tied parameters counted once, ignored ones not).
    Only modules that run forward qualify, and only if no parameter they hold is also
    held outside them (a tie is never split across units)."""
    slots: dict = {}  # id(param) -> how many (module, name) slots hold it in the tree
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                slots[id(p)] = slots.get(id(p), 0) + 1
    units = []

    def visit(mod: nn.Module) -> dict:
        """Parameters of mod's subtree that no unit took: id -> (param, slots inside)."""
        free: dict = {}

        def add(p, n):
            free[id(p)] = (p, free.get(id(p), (p, 0))[1] + n)

        for child in mod.children():
            for p, n in visit(child).values():
                add(p, n)
        for p in mod._parameters.values():
            if p is not None and id(p) not in ignored:
                add(p, 1)
        numel = sum(p.numel() for p, _ in free.values())
        closed = all(n == slots[key] for key, (_, n) in free.items())
        if mod is not module and numel >= min_numel and closed and _runs_forward(mod):
            units.append(mod)
            return {}
        return free

    visit(module)
    return units


def _mesh_for(device_mesh, dp_shard_dim, dp_outer_dim, process_group):
    if device_mesh is None:
        if dp_shard_dim is not None or dp_outer_dim is not None:
            raise ValueError("fully_shard_model: dp_shard_dim/dp_outer_dim name dimensions of device_mesh; "
                             "pass device_mesh too")
        return None
    if process_group is not None:
        raise ValueError("fully_shard_model: pass either device_mesh or process_group, not both")
    names = tuple(device_mesh.mesh_dim_names or ())
    for what, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
        if dim is not None and dim not in names:
            raise ValueError(f"fully_shard_model: {what}={dim!r} is not a dimension of device_mesh {names}")
    if dp_outer_dim is not None:
        if dp_shard_dim is None:
            raise ValueError("fully_shard_model: dp_outer_dim (replicate) needs dp_shard_dim (shard) as well")
        if dp_outer_dim == dp_shard_dim:
            raise ValueError(f"fully_shard_model: dp_outer_dim and dp_shard_dim both name {dp_shard_dim!r}; the "
                             "replicate and shard dimensions must differ")
        if names.index(dp_outer_dim) > names.index(dp_shard_dim):
            raise ValueError(
                f"fully_shard_model: device_mesh has dimensions {names}, with dp_shard_dim={dp_shard_dim!r} before "
                f"dp_outer_dim={dp_outer_dim!r}; hybrid sharding needs the replicate (outer) dimension first, as "
                "Megatron-FSDP and FSDP2 lay it out: build the mesh as (..., outer, ..., shard, ...)")
        return device_mesh[(dp_outer_dim, dp_shard_dim)]
    if dp_shard_dim is not None:
        return device_mesh[dp_shard_dim]
    if device_mesh.ndim != 1:
        raise ValueError(f"fully_shard_model: device_mesh has dimensions {names}; name the shard dimension "
                         "(dp_shard_dim=), for hybrid sharding the replicate one (dp_outer_dim=), for tensor "
                         "parallelism the TP one (tp_dim=)")
    return device_mesh


def _check_tp_dim(module: nn.Module, device_mesh, tp_dim, dp_dims, ignored: set) -> None:
    """Megatron-FSDP's tp_dim: the model's DTensor parameters live on device_mesh[tp_dim]."""
    dtensors = [(n, p) for n, p in module.named_parameters() if is_dtensor(p) and id(p) not in ignored]
    if tp_dim is None:
        if dtensors and device_mesh is not None and device_mesh.ndim > 1 and dp_dims[0] is None:
            raise ValueError(f"fully_shard_model: parameter '{dtensors[0][0]}' is a DTensor (tensor parallel); name the "
                             "mesh dims: dp_shard_dim= (and tp_dim=)")
        return
    names = tuple(device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()
    if tp_dim not in names:
        raise ValueError(f"fully_shard_model: tp_dim={tp_dim!r} is not a dimension of device_mesh {names or None}")
    if tp_dim in dp_dims:
        raise ValueError(f"fully_shard_model: tp_dim={tp_dim!r} also names a data-parallel dimension")
    if not dtensors:
        raise ValueError(f"fully_shard_model(tp_dim={tp_dim!r}): no parameter of {type(module).__name__} is a DTensor; "
                         f"tensor-parallelize the model first: parallelize_module(model, device_mesh[{tp_dim!r}], plan)")
    for n, p in dtensors:
        if tuple(p.device_mesh.mesh_dim_names or ()) != (tp_dim,):
            raise ValueError(f"fully_shard_model: parameter '{n}' is a DTensor on mesh dims "
                             f"{p.device_mesh.mesh_dim_names}, not on tp_dim={tp_dim!r}")


def fully_shard_model(
    module: nn.Module,
    config: FSDPConfig,
    fsdp_unit_modules: Optional[Sequence[Type[nn.Module]]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    *,
    device_mesh=None,
    dp_shard_dim: Optional[str] = None,
    dp_outer_dim: Optional[str] = None,
    tp_dim: Optional[str] = None,
    expt_device_mesh=None,
) -> nn.Module:
    """Apply fully_shard to every submodule whose type is in `fsdp_unit_modules`
    (innermost first), then to `module` itself (the root, holding the rest).
    Returns `module`; its parameters() are then this rank's shards.

    device_mesh, dp_shard_dim, dp_outer_dim (Megatron-FSDP's names): shard over the mesh
    dimension named dp_shard_dim; with dp_outer_dim too, replicate over that one (HSDP,
    fully_shard on the 2-D (dp_outer_dim, dp_shard_dim) mesh). A 1-D mesh needs no names.
    tp_dim: the dimension the model was tensor-parallelized on (torch's
    parallelize_module(model, device_mesh[tp_dim], plan), before this call): its DTensor
    parameters are checked to live there and are sharded over the data-parallel dims.
    expt_device_mesh (Megatron-FSDP's): the mesh of expert parallelism's data-parallel
    ranks, its dims named as device_mesh's (dp_shard_dim, dp_outer_dim): parameters
    Megatron-Core marks as experts (`param.allreduce == False`, each EP rank's own local
    experts) shard over expt_device_mesh[dp_shard_dim] (and replicate over dp_outer_dim),
    in a unit of their own beside the rest of each module's (fully_shard's
    ShardPlacementResult path). As in Megatron-FSDP, every gradient is divided by the
    dense data-parallel size, experts' too."""
    if not isinstance(config, FSDPConfig):
        raise TypeError(f"fully_shard_model expects an FSDPConfig, got {type(config).__name__}")
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError("ignored_params must be an iterable of parameters (e.g. [module.bias]), got a single tensor")
    ignored_params = list(ignored_params or ())
    kinds = tuple(fsdp_unit_modules or ())
    for k in kinds:
        if not (isinstance(k, type) and issubclass(k, nn.Module)):
            raise TypeError(f"fsdp_unit_modules must hold nn.Module classes, got {k!r}")
    mesh = _mesh_for(device_mesh, dp_shard_dim, dp_outer_dim, process_group)
    placement = _expert_placement(expt_device_mesh, device_mesh, dp_shard_dim, dp_outer_dim)
    _check_tp_dim(module, device_mesh, tp_dim, (dp_shard_dim, dp_outer_dim), set(map(id, ignored_params)))
    kwargs = dict(
        process_group=process_group,
        mesh=mesh,
        sharding_strategy=config.data_parallel_sharding_strategy,
        mp_policy=config.mp_policy,
        ignored_params=ignored_params,
        prefetch_depth=1 if config.overlap_param_gather else 0,
        create_all_gather_group=config.create_all_gather_group,
        all_gather_in_start_param_sync=config.fsdp_all_gather_in_start_param_sync,
        overlap_grad_reduce=config.overlap_grad_reduce,
        check_for_nan_in_grad=config.check_for_nan_in_grad,
        timeout=config.collective_timeout,
        shard_placement_fn=placement,
    )
    if kinds:
        units = [m for m in module.modules() if m is not module and isinstance(m, kinds)]
        if not units:
            raise ValueError(
                f"fully_shard_model: no submodule of {type(module).__name__} is one of "
                f"{[k.__name__ for k in kinds]} (fsdp_unit_modules)"
            )
        units = units[::-1]  # reversed pre-order: every descendant before its ancestors
    elif config.bucket_size is not None:
        units = _size_based_units(module, config.bucket_size, {id(p) for p in ignored_params})
    else:
        units = []
    offload = _offload_choice(module, units, ignored_params, config)
    for m, off in zip(units + [module], offload):
        fully_shard(m, **kwargs, offload_policy=off)
    if config.nccl_ub:
        for m in units + [module]:
            m.set_allocate_memory_from_process_group_for_comm(True)
    if placement is not None:
        dense_size = mesh.size() if mesh is not None else dist.get_world_size(process_group)
        for m in units + [module]:
            m.set_gradient_divide_factor(float(dense_size))
    return module


def _expert_placement(expt_device_mesh, device_mesh, dp_shard_dim, dp_outer_dim):
    """shard_placement_fn for Megatron-FSDP's expt_device_mesh: Megatron-Core's expert
    parameters (allreduce=False) on its data-parallel dims, the rest on the call's mesh."""
    if expt_device_mesh is None:
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo, HSDPMeshInfo,
                                                                  ShardPlacementResult)

    if device_mesh is None:
        raise ValueError("fully_shard_model(expt_device_mesh=...): pass device_mesh too (the dense parameters' "
                         "mesh, with the same dim names)")
    expert_mesh = _mesh_for(expt_device_mesh, dp_shard_dim, dp_outer_dim, None)
    if expert_mesh.ndim == 2:
        info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        info = FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)
    return lambda p: ShardPlacementResult(None, info) if getattr(p, "allreduce", True) is False else None


def _offload_choice(module: nn.Module, units: list, ignored_params: list, config: FSDPConfig) -> list:
    """Per unit (`units`, then the root): the CPUOffloadPolicy it gets, or None."""
    if not config.optimizer_cpu_offload:
        return [None] * (len(units) + 1)
    from torch.distributed.fsdp import CPUOffloadPolicy

    claimed = set(map(id, ignored_params))
    numels = []
    for m in units + [module]:  # each unit holds what no unit before it took
        own = [p for p in m.parameters() if id(p) not in claimed]
        claimed.update(map(id, own))
        numels.append(sum(p.numel() for p in own))
    policy = CPUOffloadPolicy(pin_memory=config.offload_pin_memory)
    return [policy if take else None for take in offloaded_units(numels, config.optimizer_offload_fraction)]


__all__ = ["FSDPConfig", "fully_shard_model", "SHARDING_STRATEGIES"]
