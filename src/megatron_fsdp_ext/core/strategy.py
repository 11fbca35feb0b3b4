"""Sharding strategies by name. What each one means is defined once, in csrc/strategy.h,
and exported as properties of `_C.ShardingStrategy` (replicated, gathers,
keeps_unsharded, keeps_gathered, full_grads): every module asks those properties; none
compares strategy names."""
from __future__ import annotations

from .. import _C

# Megatron-FSDP's names, in the table's order.
SHARDING_STRATEGIES = {s.megatron_name: s for s in _C.sharding_strategies()}


def sharding_strategy(name) -> "_C.ShardingStrategy":
    """The strategy called `name`; anything else raises ValueError listing the names."""
    if not isinstance(name, str) or name not in SHARDING_STRATEGIES:
        raise ValueError(
            f"unknown sharding_strategy {name!r}; choose from {', '.join(repr(k) for k in SHARDING_STRATEGIES)}")
    return SHARDING_STRATEGIES[name]
