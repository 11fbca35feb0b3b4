"""A value state_dict() handed out, watched until the unit's next use.

On a plain module and under FSDP2 a state-dict value is the parameter's storage, so a
write into it is a write into the parameter, whenever it happens and whether or not the
caller keeps the dict. Ours is a copy (our shards are not FSDP2's rows), and the writes
are carried back at the unit's next use (state_dict.apply_state_dict_writes). The watch
keeps the value weakly, so a state dict nobody keeps costs no memory. But a dict written
and then dropped before that use must still count: timm's EMA writes into
`ema.state_dict().values()` of a temporary dict, and a helper may `dcp.load` into
`{"model": model.state_dict()}` and return. So when the caller drops the value, the watch
keeps its storage (an alias, no copy) until the next use, and a fingerprint taken when it
was handed out tells there, without a collective, whether it was written at all: one not
written is let go; one written counts, as if the caller still had it.

The same fingerprint decides for a value the caller still holds: it counts as written
only if it changed since it was handed out (or since its last write-back). Comparing it
with the live parameter instead would take a change made on the parameter's side
(`p.mul_(0.5)`, `init_weights()` again) for a write into a value held all along (torchtitan's
CheckpointManager keeps `model.state_dict()` from its construction), and put the old
values back.

The fingerprint is two sums over the value, neither needing a temporary as large as the
value: its bits as integers of the element's size, wrapping (exact: any single changed
element changes it), and its floating sum. The value's version counter is kept beside
it: a write that only permutes elements, or puts back the values handed out, moves the
version; a torch._foreach_* op on a DTensor moves no version but the fingerprint. On a
dtype without both sums every value counts as written and takes the element-for-element
comparison instead.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor

_BITS_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT_SUM = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
              torch.float64: torch.float64}

Fingerprint = Optional[Tuple[torch.Tensor, torch.Tensor]]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def fingerprint(local: torch.Tensor) -> Fingerprint:
    """(bit sum, float sum) of `local`, on its device (no host sync), or None where the
    dtype or layout has no cheap exact fingerprint."""
    sum_dtype = _FLOAT_SUM.get(local.dtype)
    if sum_dtype is None or not local.is_contiguous():
        return None
    with torch.no_grad():
        flat = local.detach().reshape(-1)
        bits = _BITS_OF_SIZE[flat.element_size()]
        return flat.view(bits).sum(dtype=bits), flat.sum(dtype=sum_dtype)


def _differs(before: Fingerprint, after: Fingerprint) -> torch.Tensor:
    """A 0-d bool tensor: whether the fingerprints differ (NaN sums equal each other)."""
    (bits0, sum0), (bits1, sum1) = before, after
    return (bits0 != bits1) | ((sum0 != sum1) & ~(sum0.isnan() & sum1.isnan()))


class HandedOutValue:
    """The watch on one handed-out value. Called, it gives the value while the caller
    holds it, else the kept alias of a dropped one, else None (dropped while nobody
    watched it)."""
    __slots__ = ("_ref", "_kept", "_print", "_version", "_written", "__weakref__")

    def __init__(self, value: torch.Tensor):
        self._ref = weakref.ref(value)
        self._kept: Optional[Tuple[torch.Tensor, object]] = None  # (local, DTensor spec or None)
        # Whether a dropped value was written since it was handed out: None until settled.
        self._written: Optional[bool] = None
        local = _local(value)
        self._print = fingerprint(local)
        # The value's own counter: an in-place op on a DTensor moves the wrapper's, not
        # its local tensor's (a plain value's alias shares it).
        self._version = value._version
        # The finalizer keeps only the local storage (and the spec to rebuild the DTensor
        # around it) and this watch weakly: the value's own lifetime is the caller's.
        spec = value._spec if isinstance(value, DTensor) else None
        finalizer = weakref.finalize(value, HandedOutValue._dropped, weakref.ref(self), local.detach(), spec)
        finalizer.atexit = False

    @staticmethod
    def _dropped(watch_ref, local: torch.Tensor, spec) -> None:
        # Finalizers run wherever a collection happens (inside another op, under tracing):
        # keep the pieces only; the DTensor is built when it is read.
        watch = watch_ref()
        if watch is not None:
            watch._kept = (local, spec)

    def is_of(self, value: torch.Tensor) -> bool:
        return self._ref() is value

    def caller_value(self) -> Optional[torch.Tensor]:
        return self._ref()

    def caller_holds(self) -> bool:
        return self._ref() is not None

    def has_value(self) -> bool:
        """Whether there is a value to read (held by the caller, or a kept alias)."""
        return self._ref() is not None or self._kept is not None

    def __call__(self) -> Optional[torch.Tensor]:
        value = self._ref()
        if value is not None or self._kept is None:
            return value
        local, spec = self._kept
        return local if spec is None else DTensor(local, spec, requires_grad=False)

    def _current_local(self) -> Optional[torch.Tensor]:
        value = self._ref()
        if value is not None:
            return _local(value)
        return self._kept[0] if self._kept is not None else None

    @staticmethod
    def counts_as_written(watches: Sequence["HandedOutValue"]) -> List[bool]:
        """For each watch: whether its value was written since it was handed out (or
        since its last write-back, `resync`), as this rank sees it, whether the caller
        still holds it or dropped it. A value without a fingerprint counts as written
        (the write-back then compares it element for element). A dropped value's alias
        stays callable either way until the watch itself goes (the rows of a value written
        on one rank only are rebuilt from every rank's). One host sync per device."""
        checks: dict = {}
        written: dict = {}
        for w in watches:
            local = w._current_local()
            if local is None:
                written[id(w)] = False
            elif w._ref() is None and w._written is not None:  # a dropped value, settled before
                written[id(w)] = w._written
            elif w._print is None:
                written[id(w)] = True
            else:
                checks.setdefault(local.device, []).append((w, local))
        for group in checks.values():
            changed = torch.stack([_differs(w._print, fingerprint(local)) for w, local in group]).tolist()
            for (w, _), c in zip(group, changed):
                # Either tells: the version misses torch._foreach_* ops on DTensors (they
                # bump none), the fingerprint a write that only permutes elements or puts
                # back the values handed out.
                written[id(w)] = bool(c) or w._moved()
        for w in watches:
            if w._ref() is None:
                w._written = written[id(w)]
        return [written[id(w)] for w in watches]

    def _moved(self) -> bool:
        """Whether the value's version counter moved since hand-out (or resync): read on
        the value while the caller holds it, on the kept alias of a dropped plain value
        (which shares its counter); a dropped DTensor's wrapper is gone (False)."""
        value = self._ref()
        if value is not None:
            return value._version != self._version
        if self._kept is not None and self._kept[1] is None:
            return self._kept[0]._version != self._version
        return False

    def resync(self) -> None:
        """The value was written back into its parameter: it is in step with it again, so
        only writes from now on count."""
        local = self._current_local()
        if local is not None:
            self._print = fingerprint(local)
            value = self._ref()
            self._version = (value if value is not None else local)._version
            self._written = None if value is not None else False
