"""Ranks checking in before a collective the user calls directly.

`model.state_dict()`, `load_state_dict()` and the optimizer's are collectives over each
unit's group (state_dict.py). The DDP habit `if rank == 0: torch.save(model.state_dict(),
f)` calls them on one rank: that rank would wait inside a collective until the backend's
timeout, or pair it with whatever collective the other ranks issue next (a barrier) and
exchange the wrong data. Before the first collective of such a call, every rank of the
group checks in through the job's c10d store instead, which issues no collective:

- a rank that has waited MFSDP_ARRIVAL_WARN_S seconds (default 30) warns, naming the
  ranks that have not called it;
- one that waits past the group's collective timeout (fully_shard(timeout=), else the
  backend's default) raises, naming them; none of its collectives was issued.

Three store operations per rank and group for each outermost call (state_dict() of a
model checks each group once, however many units it has), and nothing in training steps.
"""
from __future__ import annotations

import datetime
import os
import time
import warnings
from typing import Dict, Optional

import torch.distributed as dist

from . import backends

_PREFIX = "mfsdp/arrival"
_calls: Dict[str, int] = {}  # per group: this rank's checked calls so far (equal on every rank)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None  # no store to meet in: the collective itself is the only check


def _warn_after_s() -> float:
    raw = os.environ.get("MFSDP_ARRIVAL_WARN_S", "30")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MFSDP_ARRIVAL_WARN_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"MFSDP_ARRIVAL_WARN_S must be positive, got {raw!r}")
    return value


def group_timeout(group, unit_timeout: Optional[datetime.timedelta]) -> datetime.timedelta:
    """The longest a collective of `group` may wait: the unit's fully_shard(timeout=), else
    the backend's default (torch's process-group timeout)."""
    if unit_timeout is not None:
        return unit_timeout
    try:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
    except (AttributeError, RuntimeError, ValueError):
        return dist.default_pg_timeout


def await_group(group, what: str, timeout: datetime.timedelta) -> None:
    """Return once every rank of `group` has called this for its current call of `what`;
    warn while some have not, raise (naming them) once `timeout` has passed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    if size == 1 or not backends.moves_data(group):
        return
    store = _store()
    if store is None:
        return
    name = getattr(group, "group_name", None) or str(dist.get_process_group_ranks(group))
    call = _calls[name] = _calls.get(name, 0) + 1
    me = dist.get_rank(group)
    base = f"{_PREFIX}/{name}/"
    store.set(f"{base}{call}/{me}", b"")
    if store.add(f"{base}{call}/count", 1) == size:
        store.set(f"{base}{call}/all", b"")
    _forget(store, base, call - 2, me)  # every rank passed call-2 before anyone entered call-1
    done = [f"{base}{call}/all"]
    start = time.monotonic()
    limit = timeout.total_seconds()
    warn_after = min(_warn_after_s(), limit)
    if _wait(store, done, warn_after):
        return
    ranks = dist.get_process_group_ranks(group)
    missing = _missing(store, base, call, ranks)
    left = limit - (time.monotonic() - start)
    if left > 0:
        warnings.warn(
            f"megatron_fsdp_ext: rank {dist.get_rank()} has waited {warn_after:g} s in {what} for rank(s) "
            f"{missing} to call it too. It is a collective over the ranks {ranks}: called on some ranks only "
            f"(`if rank == 0: torch.save(model.state_dict(), ...)`) it never completes. Call it on every "
            f"rank and save on one (`sd = model.state_dict(); if rank == 0: torch.save(sd, ...)`). Waiting "
            f"{left:.0f} s more (the group's collective timeout)", stacklevel=2)
        if _wait(store, done, left):
            return
        missing = _missing(store, base, call, ranks)
    # Withdrawn, so that the ranks meet again at this call number if the caller goes on
    # (a save that failed and was caught): every later call would fail otherwise.
    _calls[name] = call - 1
    store.add(f"{base}{call}/count", -1)
    store.delete_key(f"{base}{call}/{me}")
    raise RuntimeError(
        f"megatron_fsdp_ext: {what} is a collective over the ranks {ranks}, and rank(s) {missing} did not call "
        f"it within {limit:g} s (this is rank {dist.get_rank()}); no collective was issued. Call it on every "
        f"rank and save on one: `sd = model.state_dict(); if rank == 0: torch.save(sd, path)` (or "
        f"torch.distributed.checkpoint / get_model_state_dict(..., full_state_dict=True, cpu_offload=True))")


def _wait(store, keys, seconds: float) -> bool:
    try:
        store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except RuntimeError:  # the store's timeout (DistStoreError on TCPStore)
        return False


def _missing(store, base: str, call: int, ranks) -> list:
    return [r for i, r in enumerate(ranks) if not store.check([f"{base}{call}/{i}"])]


def _forget(store, base: str, call: int, me: int) -> None:
    if call < 1:
        return
    keys = [f"{base}{call}/{me}"] + ([f"{base}{call}/count", f"{base}{call}/all"] if me == 0 else [])
    for key in keys:
        try:
            store.delete_key(key)
        except (RuntimeError, NotImplementedError):
            return  # a store without deletion keeps a few bytes per call
