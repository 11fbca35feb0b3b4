"""Per-rank memory of a sharded model before it exists: parameters, gradients, optimizer
state and the units gathered at once, from shapes alone (a model on the meta device is
enough). Activations are not estimated: they depend on the model's forward, not on
sharding; add them from a single-GPU measurement of one micro-batch.

The accounting follows what the units allocate (unit.h, unit.cpp):
  - shards: each unit's flat layout segment, in the parameters' own dtype;
  - sharded gradients: the whole segment in that dtype for a unit with any trainable
    parameter (ZeRO-1 with a full-precision reduction keeps the whole flat gradient alive
    behind its segment; no_shard keeps all);
  - optimizer state: per element of each trainable parameter's shard, in the parameters'
    dtype (AdamW: 2, SGD with momentum: 1, "none": 0), the largest over ranks;
  - gathered parameters, in the compute dtype (one byte an element for weights torchao
    asked to gather in FP8, fp8.py, plus a scale byte per 32 for MXFP8; the unit's byte
    layout, gather_bytes.h): every unit under strategies that keep them
    (optim, optim_grads; no_shard only when it casts), else the root (gathered through
    the whole step) plus the largest unit 1 + prefetch_depth times;
  - reduction buffers: one unit's unsharded gradients (compute dtype) and two flat
    reduce-dtype buffers (the one being packed and the one in flight); with reduce
    buckets, the same for the largest bucket's units together. An offloaded unit also
    lands its reduced segment on the device before copying it out.
  - offloaded units (offload_fraction, options.offloaded_units): their shard, gradient
    and the bf16 gather copy (a bf16 param_dtype over fp32 shards) in pinned host memory,
    the optimizer state in pageable host memory; not in the device total.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Type, Union

import torch
import torch.nn as nn

from .. import _C
from ..precision import fp8
from ..core.construct import post_forward_size_of
from ..core.options import MixedPrecisionPolicy, as_mp_policy, check_count, offloaded_units
from ..core.schedule import bucket_runs
from ..core.strategy import sharding_strategy as strategy_named
from ..core.dtensor_face import is_dtensor

_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_momentum": 1, "none": 0}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the largest over ranks where shards are uneven)."""

    params: int
    grads: int
    optimizer_state: int
    gathered_params: int
    reduction_buffers: int
    num_units: int
    shard_size: int
    host_pinned: int = 0     # offloaded units: shards, gradients, bf16 gather copies
    host_pageable: int = 0   # offloaded units: optimizer state (everything, unpinned)

    @property
    def total(self) -> int:
        """Device bytes."""
        return self.params + self.grads + self.optimizer_state + self.gathered_params + self.reduction_buffers

    @property
    def host_total(self) -> int:
        return self.host_pinned + self.host_pageable

    def __str__(self) -> str:
        gib = 2 ** 30
        rows = [("parameters (shards)", self.params), ("gradients (shards)", self.grads),
                ("optimizer state", self.optimizer_state), ("gathered parameters", self.gathered_params),
                ("reduction buffers", self.reduction_buffers), ("total, without activations", self.total)]
        width = max(len(r[0]) for r in rows)
        lines = [f"per rank, {self.num_units} units sharded over {self.shard_size} ranks:"]
        lines += [f"  {name:<{width}}  {nbytes / gib:9.3f} GiB" for name, nbytes in rows]
        if self.host_total:
            lines += [f"  {'host, pinned':<{width}}  {self.host_pinned / gib:9.3f} GiB",
                      f"  {'host, pageable':<{width}}  {self.host_pageable / gib:9.3f} GiB"]
        return "\n".join(lines)


def _shard_size(mesh_or_world) -> int:
    if isinstance(mesh_or_world, bool) or not isinstance(mesh_or_world, int):
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh_or_world, DeviceMesh):
            raise TypeError(f"estimate_memory: pass the number of ranks sharding a unit (int) or a DeviceMesh, "
                            f"got {type(mesh_or_world).__name__}")
        if mesh_or_world.ndim not in (1, 2):
            raise ValueError(f"estimate_memory: a 1-D or (replicate, shard) 2-D mesh, got {mesh_or_world.ndim}-D")
        return mesh_or_world.size(mesh_or_world.ndim - 1)
    if mesh_or_world < 1:
        raise ValueError(f"estimate_memory: the number of ranks must be >= 1, got {mesh_or_world}")
    return mesh_or_world


def _replicates(mesh_or_world) -> bool:
    """A (replicate, shard) mesh with more than one replica: reductions end in an all-reduce."""
    return not isinstance(mesh_or_world, int) and mesh_or_world.ndim == 2 and mesh_or_world.size(0) > 1


def _full_numel(p: torch.Tensor) -> int:
    """The parameter's full numel: a model already sharded holds 1-D shards, whose unit
    knows the full shape."""
    owner = getattr(p, "_mfsdp_owner", None)
    state = owner() if owner is not None else None
    if state is not None:  # what the unit gathers: a tensor-parallel parameter's local TP shard
        for s, u in zip(state.sharded_params, state.unit.unsharded_locals):
            if s is p:
                return u.numel()
    return p.to_local().numel() if is_dtensor(p) else p.numel()


def _units(model: nn.Module, unit_modules) -> List[List[nn.Parameter]]:
    """Parameters of each unit as fully_shard_model would make them: every module of a
    unit class (innermost first) takes what no inner unit took; the root the rest."""
    claimed, units = set(), []
    kinds = (unit_modules,) if isinstance(unit_modules, type) else tuple(unit_modules)
    for k in kinds:
        if not (isinstance(k, type) and issubclass(k, nn.Module)):
            raise TypeError(f"estimate_memory: unit_modules must hold nn.Module classes, got {k!r}")
    modules = [m for m in model.modules() if m is not model and isinstance(m, kinds)][::-1] + [model]
    for m in modules:
        own = []
        for p in m.parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                own.append(p)
        units.append(own)
    return units


def estimate_memory(
    model: nn.Module,
    mesh_or_world,
    *,
    unit_modules: Optional[Iterable[Type[nn.Module]]] = None,
    sharding_strategy: str = "optim_grads_params",
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    optimizer: str = "adamw",
    prefetch_depth: int = 1,
    gather_bucket_bytes: int = 0,
    reduce_bucket_bytes: int = 0,
    alignment: int = _C.DEFAULT_ALIGNMENT,
    offload_fraction: float = 0.0,
    pin_memory: bool = True,
    experts: Optional[Callable[[nn.Parameter], bool]] = None,
    expert_parallel: int = 1,
    reshard_after_forward: Union[bool, int] = True,
) -> MemoryEstimate:
    """Per-rank bytes of training `model` sharded over `mesh_or_world` (an int: ranks
    per shard group; or the DeviceMesh; for HSDP its shard dimension counts), with a
    unit per module of a class in `unit_modules` plus the root, as
    fully_shard_model(..., fsdp_unit_modules=unit_modules) makes them. `optimizer`:
    "adamw"/"adam" (2 states per element), "sgd"/"sgd_momentum" (SGD with momentum: 1),
    "none". `model` may live
    on the meta device: only shapes and dtypes are read. Frozen parameters get no
    gradient and no optimizer state. `gather_bucket_bytes` as in fully_shard: gathered
    units are then counted by buckets of consecutive units (module order), 1 +
    prefetch_depth buckets at a time, the largest such window. `reduce_bucket_bytes` as
    in fully_shard: reduction buffers are counted for the largest bucket (the root first,
    then the other units in module order), unless the mesh replicates (HSDP) or the
    strategy all-reduces full gradients (no_shard, optim), which reduce per unit.
    Both are bytes (default 0): fully_shard's default "auto" picks its budgets from the
    link at run time, so pass what the root's bucket_budgets() reports (up to 256 MiB)
    to count them.
    `offload_fraction` as FSDPConfig.optimizer_offload_fraction (0: no offload, 1: every
    unit, as fully_shard(offload_policy=CPUOffloadPolicy(pin_memory)) on each): the
    offloaded units' shards, gradients and optimizer state count as host bytes.
    Mixture of experts (fully_shard with shard_placement_fn putting the routed experts on
    the expert data-parallel mesh, as torchtitan does): `experts(p)` is True for expert
    weights; each unit's experts are a unit of their own beside its dense part, split
    `expert_parallel` ways (a parameter that is already an expert-parallel DTensor counts
    its local part) and sharded over shard_size / expert_parallel ranks (the "efsdp" mesh).
    Optimizer state then counts each group's largest rank (an upper bound where shards
    are uneven).
    `reshard_after_forward` as in fully_shard for the units other than the root: False
    keeps every unit gathered from its forward to its backward; an int N keeps 1/N of each
    unit's gathered parameters until its backward (counted whole, as at the end of forward,
    beside the gathers of the largest window)."""
    shard = _shard_size(mesh_or_world)
    strategy = strategy_named(sharding_strategy)
    reshard_after_forward, keep_one_in = post_forward_size_of(reshard_after_forward, shard)
    mp = as_mp_policy(mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"estimate_memory: optimizer must be one of {sorted(_OPTIMIZER_STATES)}, got {optimizer!r}")
    check_count("prefetch_depth", prefetch_depth, "estimate_memory: ")
    check_count("gather_bucket_bytes", gather_bucket_bytes, "estimate_memory: ")
    check_count("reduce_bucket_bytes", reduce_bucket_bytes, "estimate_memory: ")
    replicated = strategy.replicated
    keeps_gathered = strategy.keeps_gathered
    params = grads = 0
    optim_by_rank = [0] * (1 if replicated else shard)  # optimizer state is per parameter: exact per rank
    gathered_all, gathered_bytes, kept_after_forward = 0, [], []  # per unit
    grad_buffers, reduce_sizes = [], []  # per unit: bytes while reduced; packed bytes
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"estimate_memory: expert_parallel must be an int >= 1, got {expert_parallel!r}")
    if experts is None and expert_parallel > 1:
        raise ValueError("estimate_memory: expert_parallel > 1 needs experts= (which parameters are routed experts)")
    if expert_parallel > 1 and (shard % expert_parallel or replicated):
        raise ValueError(f"estimate_memory: expert_parallel={expert_parallel} must divide the shard group's "
                         f"{shard} ranks (the expert data-parallel mesh has shard / expert_parallel ranks), "
                         f"under a sharding strategy (not {sharding_strategy!r})")
    units = [u for u in _units(model, unit_modules or ()) if u]
    # Per unit: (parameters, ranks sharding them, ways expert parallelism splits them).
    groups = [(u, shard, 1) for u in units]
    if experts is not None:
        groups = []
        for u in units:
            dense, routed = [p for p in u if not experts(p)], [p for p in u if experts(p)]
            split = [1 if is_dtensor(p) else expert_parallel for p in routed]
            groups += [(g, s, d) for g, s, d in ((routed, shard // expert_parallel, split), (dense, shard, 1)) if g]
        units = [g for g, _, _ in groups]
    expert_optim = 0
    offloaded = offloaded_units([sum(_full_numel(p) for p in u) for u in units], offload_fraction)
    if any(offloaded) and (replicated or strategy.full_grads):
        raise ValueError(f"estimate_memory: offload needs a strategy that reduce-scatters ('optim_grads_params' or "
                         f"'optim_grads'), not {sharding_strategy!r}")
    host_pinned = host_pageable = 0
    for (unit, unit_shard, split), off in zip(groups, offloaded):
        orig = unit[0].dtype
        b_orig = orig.itemsize
        b_param = (mp.param_dtype or orig).itemsize
        b_reduce = (mp.reduce_dtype or mp.param_dtype or orig).itemsize
        ways = split if isinstance(split, list) else [split] * len(unit)
        for p, w in zip(unit, ways):
            if _full_numel(p) % w:
                raise ValueError(f"estimate_memory: an expert weight of shape {tuple(p.shape)} does not split "
                                 f"{w} ways over expert parallelism")
        numels = [_full_numel(p) // w for p, w in zip(unit, ways)]
        fp8_weights = [fp8.fp8_weight(p) for p in unit]
        layout = _C.FlatLayout.even(numels, 1 if replicated else unit_shard,
                                    fp8.alignment_for(alignment, fp8_weights))
        seg, total = layout.max_segment_numel, layout.total_numel
        trains = [p.requires_grad for p in unit]
        # Per rank: the elements of trainable parameters in its shard (what optimizer state covers).
        trained = [sum(s.numel for s, t in zip(layout.shard_slices(r), trains) if t)
                   for r in range(1 if replicated else unit_shard)]
        if off:  # shard, gradient and the bf16 gather copy on the host; the optimizer state too
            pinned = seg * b_orig * (2 if any(trains) else 1)
            pinned += seg * b_param if (mp.param_dtype == torch.bfloat16 and orig == torch.float32) else 0
            states = max(trained) * b_orig * _OPTIMIZER_STATES[optimizer]
            host_pinned += pinned if pin_memory else 0
            host_pageable += states + (0 if pin_memory else pinned)
        else:
            params += seg * b_orig
            # A unit with any gradient holds its whole segment of gradients (one flat buffer
            # behind the .grad views; ZeRO-1 with a full-precision reduction the whole flat one).
            full_grad_kept = strategy.full_grads and b_reduce == b_orig
            if any(trains):
                grads += (total if full_grad_kept else seg) * b_orig
            if unit_shard != shard:  # an expert group: its own ranks
                expert_optim += max(trained) * b_orig * _OPTIMIZER_STATES[optimizer]
            else:
                for r, n in enumerate(trained):
                    optim_by_rank[r] += n * b_orig
        widths = [1 if w is not None else b_param for w in fp8_weights]
        if 1 in widths:  # the FP8 gather: a byte layout (never aliases the shard), MXFP8 scales after it
            mx = any(isinstance(w, fp8.MXWeight) for w in fp8_weights)
            gathered = _C.gather_bytes_of(layout, widths).total + (layout.total_numel // fp8.MX_BLOCK if mx else 0)
        else:
            gathered = 0 if (replicated and b_param == b_orig) else total * b_param
        gathered_all += gathered
        gathered_bytes.append(gathered)
        # reshard_after_forward=N: a group of another size keeps nothing where N covers it whole.
        kept_after_forward.append(gathered // keep_one_in if keep_one_in and unit_shard > keep_one_in else 0)
        # One unit's unsharded gradients (compute dtype, trainable parameters only) and
        # two flat reduce-dtype buffers (the one being packed, the one in flight).
        trainable = sum(n for n, t in zip(numels, trains) if t)
        landing = seg * b_orig if off else 0  # an offloaded unit's reduced segment, before its copy out
        grad_buffers.append(trainable * b_param + 2 * total * b_reduce + landing if trainable else 0)
        reduce_sizes.append(total * b_reduce)
    optim = max(optim_by_rank, default=0) * _OPTIMIZER_STATES[optimizer] + expert_optim
    # Forward order: the root first, then the other units in module order (_units lists
    # them innermost-last-first, the root last).
    forward = [len(units) - 1] + list(range(len(units) - 2, -1, -1)) if units else []
    if keeps_gathered or replicated or not reshard_after_forward:
        gathered_params = gathered_all
    else:
        root = gathered_bytes[forward[0]] if units else 0
        blocks = [gathered_bytes[i] for i in forward[1:]]
        if gather_bucket_bytes > 0:
            buckets = [sum(blocks[r.start: r.stop]) for r in bucket_runs(blocks, gather_bucket_bytes)]
            window = 1 + prefetch_depth
            gathered_params = root + max((sum(buckets[i:i + window]) for i in range(len(buckets))), default=0)
        else:
            gathered_params = root + sum(sorted(blocks, reverse=True)[:1 + prefetch_depth])
        gathered_params += sum(kept_after_forward[i] for i in forward[1:])
    shares_reductions = not (strategy.full_grads or _replicates(mesh_or_world))
    if reduce_bucket_bytes > 0 and shares_reductions and grad_buffers:
        runs = bucket_runs([reduce_sizes[i] for i in forward], reduce_bucket_bytes)
        reduction_buffers = max(sum(grad_buffers[forward[i]] for i in r) for r in runs)
    else:
        reduction_buffers = max(grad_buffers, default=0)
    return MemoryEstimate(params=params, grads=grads, optimizer_state=optim, gathered_params=gathered_params,
                          reduction_buffers=reduction_buffers, num_units=len(units), shard_size=shard,
                          host_pinned=host_pinned, host_pageable=host_pageable)


__all__ = ["MemoryEstimate", "estimate_memory"]
