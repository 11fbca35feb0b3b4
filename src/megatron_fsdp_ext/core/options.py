"""The frozen objects fully_shard's options become: UnitOptions (how one unit behaves),
MixedPrecisionPolicy (its dtypes), and the argument checks they share (counts, timeouts).

UnitOptions: how one fully_shard unit behaves, as one frozen object.

fully_shard builds it and hands it to the unit's FSDPState; the FSDPModule setters
(set_reshard_after_forward, set_prefetch_depth, ...) replace it whole through
FSDPState.set_options, the one writer, which also re-checks it. What changes every
step (requires_gradient_sync) and what describes the backward in progress are state,
not options: they live on FSDPState (states.py).
"""
from __future__ import annotations

import datetime
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .. import _C
from .link import AUTO, LinkModel
from .strategy import sharding_strategy


def check_count(name: str, value, what: str = "") -> None:
    """`value` must be an int >= 0 (not a bool); the error names `name`, after `what`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}{name} must be an int >= 0, got {value!r}")


def check_bucket_bytes(name: str, value, what: str = "") -> None:
    """A bucket budget: an int >= 0 or "auto" (link.py)."""
    if value == AUTO and isinstance(value, str):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}{name} must be an int >= 0 or {AUTO!r}, got {value!r}")


@dataclass(frozen=True)
class UnitOptions:
    sharding_strategy: str = "optim_grads_params"  # Megatron-FSDP's names (strategy.SHARDING_STRATEGIES)
    mp_policy: Any = None  # MixedPrecisionPolicy
    # Free the gathered parameters after forward (the root never does: its backward
    # starts right after; FSDPState.reshard_after_forward is the effective value).
    reshard_after_forward: bool = True
    # FSDP2's reshard_after_forward=int N: after forward each rank keeps its 1/N of the
    # gathered parameters (N consecutive ranks of the shard group hold them whole), and
    # backward gathers over those N ranks only; a unit whose group has N ranks frees all
    # of it. 0: free all of it (plain True).
    post_forward_shard_size: int = 0
    # Units all-gathered ahead of use; the root's value governs its tree.
    prefetch_depth: int = 1
    # (root) Consecutive units (recorded forward order) whose gathered bytes add up to at
    # most this many share one coalesced all-gather; 0: one collective per unit; "auto":
    # the budget the link measures at the end of the first backward (link.py).
    gather_bucket_bytes: Union[int, str] = AUTO
    # (root) The same for gradients: consecutive units whose packed gradients add up to at
    # most this many bytes are reduce-scattered by one coalesced collective once the last
    # of them is done with backward. HSDP and full-gradient strategies reduce per unit.
    reduce_bucket_bytes: Union[int, str] = AUTO
    # (root) The link "auto" budgets are planned from, instead of timing it (None): a
    # measured model reused, or the real machine's under torch's fake backend.
    link_model: Optional[LinkModel] = None
    # (root) start_param_sync() launches the first all-gathers after the optimizer step.
    all_gather_in_start_param_sync: bool = False
    # False: backward waits for each gradient reduction before going on (debugging).
    overlap_grad_reduce: bool = True
    # FSDP2's set_reshard_after_backward / set_unshard_in_backward.
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    # Megatron's check_for_nan_in_grad: reduced gradient shards are checked for NaN/Inf on
    # the device; the optimizer step (or clip_grad_norm_) refuses to run on them.
    check_for_nan_in_grad: bool = False
    # FSDP2's set_allocate_memory_from_process_group_for_comm (Megatron-FSDP's nccl_ub):
    # the all-gather output and reduce-scatter input come from the group's backend
    # (NCCL: registered memory the collectives run on in place; csrc/comm_buffers.h).
    comm_buffers_from_group: bool = False

    def __post_init__(self):
        sharding_strategy(self.sharding_strategy)
        check_count("prefetch_depth", self.prefetch_depth)
        check_count("post_forward_shard_size", self.post_forward_shard_size)
        for name in ("gather_bucket_bytes", "reduce_bucket_bytes"):
            check_bucket_bytes(name, getattr(self, name))
        if self.link_model is not None and not isinstance(self.link_model, LinkModel):
            raise TypeError(f"link_model must be a megatron_fsdp_ext.link.LinkModel or None, got {self.link_model!r}")
        for name in ("reshard_after_forward", "all_gather_in_start_param_sync", "overlap_grad_reduce",
                     "reshard_after_backward", "unshard_in_backward", "check_for_nan_in_grad",
                     "comm_buffers_from_group"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.reshard_after_forward and self.keeps_params_unsharded:
            raise ValueError(
                f"reshard_after_forward=True contradicts sharding_strategy={self.sharding_strategy!r}, which keeps "
                "parameters unsharded between uses; use 'optim_grads_params' to free them after forward")
        if self.post_forward_shard_size and not self.reshard_after_forward:
            raise ValueError(f"post_forward_shard_size={self.post_forward_shard_size} needs "
                             "reshard_after_forward=True (it says what a reshard after forward keeps)")

    # Cached: read in the hooks every step (a frozen instance never changes; the setters
    # make a new one).
    @functools.cached_property
    def strategy(self):
        """The strategy as `_C.ShardingStrategy`, whose properties say what it means."""
        return sharding_strategy(self.sharding_strategy)

    @functools.cached_property
    def keeps_params_unsharded(self) -> bool:
        return self.strategy.keeps_unsharded


# The dtypes units store, gather and reduce in (csrc/dtypes.h: one definition).
FLOAT_DTYPES = tuple(_C.supported_float_dtypes())


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters, the gradient reduction and the outputs.

    param_dtype:  dtype parameters are all-gathered and computed in (None: as stored).
    reduce_dtype: dtype gradients are reduce-scattered in (None: param_dtype).
    output_dtype: dtype floating outputs of the module are cast to (None: unchanged).
    cast_forward_inputs: cast floating inputs to param_dtype before forward.
    The sharded master parameters always stay in their original dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{field} must be a torch.dtype, got {value!r}")
            if value not in FLOAT_DTYPES:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field} must be a floating-point dtype "
                    f"(one of {', '.join(str(d) for d in FLOAT_DTYPES)}), got {value}"
                )


def as_mp_policy(policy) -> MixedPrecisionPolicy:
    """Ours as is; torch's FSDP2 MixedPrecisionPolicy converted field by field."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype,
                                    cast_forward_inputs=policy.cast_forward_inputs)
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (ours or torch.distributed.fsdp's), "
                    f"got {type(policy).__name__}")


def as_timeout(timeout) -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    value = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout) if math.isfinite(timeout) else None
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta or number of seconds, got {value!r}")
    return timeout


def check_offload_fraction(fraction, what: str = "") -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{what}offload fraction must be a number in [0, 1], got {fraction!r}")
    return float(fraction)


def offloaded_units(numels, fraction: float) -> list:
    """Partial offload (Megatron's optimizer_offload_fraction): which of the units, listed
    in the order fully_shard_model shards them (inner units first, the root last), are
    offloaded so that at least `fraction` of all parameter elements live in host memory.
    Whole units, the first ones in that order: 0 offloads none, 1 all of them. The one
    rule fully_shard_model and estimate_memory share."""
    fraction = check_offload_fraction(fraction)
    total = sum(numels)
    chosen, offloaded = [], 0
    for n in numels:
        take = fraction > 0 and offloaded < fraction * total
        chosen.append(take)
        offloaded += n if take else 0
    return chosen
