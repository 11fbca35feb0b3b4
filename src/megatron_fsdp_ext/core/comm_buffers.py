"""Where a unit's communication buffers come from: torch's caching allocator, or the
process group's backend (UnitOptions.comm_buffers_from_group; csrc/comm_buffers.h).

Applied when the root is made and by the setter after that. No collective: a group's
buffers come from its backend once the group has run a collective on the device."""
from __future__ import annotations

import warnings

from .. import _C

_warned = False


def apply_comm_buffer_source(state) -> None:
    """Hands `state`'s option to its unit; warns once per process where it was asked for
    and no group of the unit can allocate."""
    global _warned
    unit = state.unit
    if unit is None:
        return
    wanted = state.options.comm_buffers_from_group
    source = _C.CommBufferSource.PROCESS_GROUP if wanted else _C.CommBufferSource.CACHING_ALLOCATOR
    if unit.comm_buffer_source == source:
        return
    groups_allocate = unit.set_comm_buffer_source(source)
    if wanted and not groups_allocate and state.process_group.size() > 1 and not _warned:
        _warned = True
        warnings.warn(
            f"set_allocate_memory_from_process_group_for_comm(True) on {state.label or state.module_kind}: its "
            f"process group (backend {state.process_group.name()!r}) does not allocate {unit.device} memory for "
            "collectives (NCCL does, on devices with NVLink multicast); torch's caching allocator is kept",
            stacklevel=3)
