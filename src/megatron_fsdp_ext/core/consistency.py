"""Cross-rank check that every rank built the same units.

Ranks whose models differ in a parameter's shape, in registration order or in the
sharding options can pad to the same flat size: their collectives then match and
training goes on silently with mixed-up weights (or aborts inside the backend when the
sizes differ). One small all-gather of a digest per process group, once at lazy init,
turns that into an error naming the first difference (agree.digest_differs).
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from .agree import digest_differs, gather_objects


def unit_signature(name: str, state) -> str:
    """One line describing everything about a unit that must match across ranks."""
    head = f"unit '{name}' ({state.module_kind})"
    unit = state.unit
    if unit is None:
        return f"{head}: no parameters"
    params = "; ".join(
        f"{n} {tuple(u.shape)} {str(p.dtype).removeprefix('torch.')}"
        for n, u, p in zip(state.names, state.unsharded_params, state.sharded_params)
    )
    o = state.options
    # Everything that decides which collectives run, of what size, in which order.
    options = (f"strategy={o.sharding_strategy} param_dtype={unit.param_dtype} "
               f"reduce_dtype={unit.reduce_dtype} alignment={unit.layout.alignment} "
               f"ranks={dist.get_process_group_ranks(state.process_group)} "
               f"reshard_after_forward={o.post_forward_shard_size or o.reshard_after_forward} "
               f"prefetch_depth={o.prefetch_depth} "
               f"gather_bucket_bytes={o.gather_bucket_bytes} reduce_bucket_bytes={o.reduce_bucket_bytes} "
               f"unshard_in_backward={o.unshard_in_backward} reshard_after_backward={o.reshard_after_backward} "
               f"all_gather_in_start_param_sync={o.all_gather_in_start_param_sync}")
    return f"{head}: {options}; params: {params}"


def check_units_agree(named_states, device: torch.device) -> None:
    """Collective over each process group the units use (in first-use order, the same
    on every rank of that group): raises ValueError on every rank if any rank's units
    differ, naming the first differing unit on each side."""
    by_group: Dict[int, tuple] = {}
    for name, state in named_states:
        group = state.check_group
        entry = by_group.setdefault(id(group), (group, []))
        entry[1].append(unit_signature(name, state))
    for group, lines in by_group.values():
        try:
            differs = digest_differs(lines, group, device)
        except RuntimeError as e:
            raise RuntimeError(
                f"megatron_fsdp_ext: the cross-rank consistency check at the first forward failed on rank "
                f"{dist.get_rank()} ({e}). Every rank must reach its first forward: a rank that stalls or "
                "skipped it leaves the others waiting until the collective timeout") from e
        if differs:
            _raise_first_difference(lines, group)


def _raise_first_difference(lines: List[str], group) -> None:
    me = dist.get_rank()
    for other, theirs in gather_objects(lines, group).items():
        if theirs == lines:
            continue
        i = next((k for k, (a, b) in enumerate(zip(lines, theirs)) if a != b), min(len(lines), len(theirs)))
        mine_line = lines[i] if i < len(lines) else "(no such unit)"
        their_line = theirs[i] if i < len(theirs) else "(no such unit)"
        raise ValueError(
            f"fully_shard: ranks built different models (they must build the same modules, parameters, "
            f"shapes, dtypes and sharding options, in the same order; options that decide the collectives, such as "
            f"gather_bucket_bytes, must be equal too); first difference at unit #{i}:\n"
            f"  rank {me}: {mine_line}\n  rank {other}: {their_line}"
        )
    raise AssertionError("digests differed but every rank's unit list is equal")  # a hash collision
