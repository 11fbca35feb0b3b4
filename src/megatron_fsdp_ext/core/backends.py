"""What a process group's backend can do, by device type: the one place that decides.

Units and collectives choose by capability (csrc/backend.h: flat, coalesced and uneven
collectives, whether the host waits, whether data moves at all), never by the backend's
name, so any c10d backend works: NCCL, Gloo with CPU *or* CUDA tensors (ranks sharing a
GPU included), torch's fake backend, mixed ones like "cpu:gloo,cuda:nccl", and backends
the table does not know (plain collectives only, or what register_backend_capabilities
declares for them).
"""
from __future__ import annotations

import warnings
from typing import Optional, Set

import torch
import torch.distributed as dist

from .. import _C

_DEVICE_TYPES = ("cpu", "cuda")


def capabilities(group, device) -> Optional["_C.BackendCaps"]:
    """What `group`'s backend can do for tensors on `device` (a torch.device or type
    string); None when the group has no backend for that device type."""
    return _C.backend_caps(group, torch.device(device))


def device_types(group) -> Set[str]:
    """The device types `group` can communicate tensors of."""
    return {t for t in _DEVICE_TYPES if capabilities(group, t) is not None}


def backend_name(group) -> str:
    return str(dist.get_backend(group))


def moves_data(group, device=None) -> bool:
    """False when the backend moves nothing (torch's fake backend) for `device`, or for
    every device type it has when `device` is None."""
    types = _DEVICE_TYPES if device is None else (torch.device(device).type,)
    found = [c for c in (capabilities(group, t) for t in types) if c is not None]
    return not found or any(c.moves_data for c in found)


def overlaps_collectives(group, device) -> bool:
    """Whether collectives on separate communicators run at the same time on the device
    (they are enqueued on streams and move data: NCCL), so a second communicator for
    all-gathers buys overlap with reduce-scatters."""
    caps = capabilities(group, device)
    return caps is not None and caps.enqueues_on_stream and caps.moves_data


_noted: Set[str] = set()


def skipped_without_data(what: str, group) -> None:
    """Say once per process that `what` is skipped because `group` moves no data."""
    if what in _noted:
        return
    _noted.add(what)
    warnings.warn(
        f"megatron_fsdp_ext: the process group's backend '{backend_name(group)}' moves no data (a simulation); "
        f"{what} skipped: every rank would only see its own values", stacklevel=3)


def check_moves_data(what: str, group) -> None:
    """Refuse `what` (reading or writing files) under a backend that moves no data: the
    result would hold this rank's values in place of every other rank's."""
    if not moves_data(group):
        raise RuntimeError(
            f"{what}: the process group's backend '{backend_name(group)}' moves no data (torch's fake backend "
            "simulates ranks without communicating), so the other ranks' shards are not here; checkpoints need a "
            "backend that communicates (NCCL, Gloo)")


def register_backend_capabilities(name: str, device_type: str, *, moves_data: bool = True,
                                  enqueues_on_stream: bool = False, flat_all_gather: bool = True,
                                  flat_reduce_scatter: bool = True, coalesced_all_gather: bool = False,
                                  coalesced_reduce_scatter: bool = False, uneven_lists: bool = False,
                                  all_to_all: bool = False) -> None:
    """Declare what backend `name` (as its Backend.getBackendName() says) can do for
    `device_type` tensors, for units made from now on in this process: a backend of your
    own, or one whose entry is wrong for your build. Unknown backends otherwise get the
    plain collectives only (allgather / allreduce / broadcast; no coalescing, padded
    uneven collectives, reduce-scatter as an all-reduce).

    moves_data: collectives really communicate (False only for simulators).
    enqueues_on_stream: a CUDA collective is enqueued on the current stream and the host
        never waits for it (enables a separate all-gather communicator by default).
    flat_all_gather / flat_reduce_scatter: _allgather_base / _reduce_scatter_base.
    coalesced_all_gather / coalesced_reduce_scatter: the *_tensor_coalesced collectives.
    uneven_lists: allgather / reduce_scatter with uneven per-rank tensors.
    all_to_all: alltoall_base with split sizes (state dicts then exchange FSDP2's rows
        instead of gathering whole units)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend_capabilities: name must be a non-empty string, got {name!r}")
    if device_type not in _DEVICE_TYPES:
        raise ValueError(f"register_backend_capabilities: device_type must be one of {_DEVICE_TYPES}, "
                         f"got {device_type!r}")
    caps = _C.BackendCaps(name, moves_data=moves_data, enqueues_on_stream=enqueues_on_stream,
                          flat_all_gather=flat_all_gather, flat_reduce_scatter=flat_reduce_scatter,
                          coalesced_all_gather=coalesced_all_gather,
                          coalesced_reduce_scatter=coalesced_reduce_scatter, uneven_lists=uneven_lists,
                          all_to_all=all_to_all)
    _C.register_backend_caps(torch.device(device_type), caps)
