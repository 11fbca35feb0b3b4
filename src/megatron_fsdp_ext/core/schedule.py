"""Which units gather and reduce when: the one place those decisions are made.

Per root: the forward order recorded in the first iteration (runtime order, frozen after
the first backward), prefetch targets in it, and the gather and reduce buckets cut from
it. The hooks ask the schedule which units to gather (`forward_gathers`,
`backward_gathers`) and whether a unit's gradients wait for its bucket
(`hold_for_reduction`). The C++ unit then decides only what it alone knows: whether a
unit asked for still needs a collective (not in flight, no current copy) and which of
them can share one.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from .link import AUTO
from .states import BackwardProgress, ForwardOrder


def bucket_runs(sizes: List[int], budget: int) -> List[range]:
    """Buckets as index runs over `sizes` (bytes in forward order): consecutive entries
    adding up to at most `budget`; one larger than the budget stands alone. Used for
    gather and reduce buckets alike (and by estimate_memory)."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        runs.append(range(start, len(sizes)))
    return runs


def _reduce_nbytes(state) -> Optional[int]:
    """Bytes of `state`'s packed gradients, or None when its reduction cannot share a
    collective (HSDP, full-gradient strategies)."""
    unit = state.unit
    return unit.layout.total_numel * unit.reduce_dtype.itemsize if unit.can_share_reduction else None


class BucketPlan:
    """Consecutive units of the frozen forward order cut into buckets of at most
    `budget` bytes (`size_of`; a unit whose size is None is in no bucket and splits the
    run it is in). Planned again when the budget changes."""

    def __init__(self, size_of):
        self._size_of = size_of
        self._budget = 0
        self.buckets: List[list] = []
        self._index: dict = {}

    def bucket_of(self, order: list, state, budget: int) -> Optional[int]:
        if budget != self._budget:
            self._plan(order, budget)
        return self._index.get(id(state))

    def _plan(self, order: list, budget: int) -> None:
        self.buckets, run = [], []
        sizes = [self._size_of(s) for s in order]
        for state, size in zip(order + [None], sizes + [None]):
            if size is not None:
                run.append((state, size))
                continue
            for r in bucket_runs([n for _, n in run], budget):
                self.buckets.append([run[i][0] for i in r])
            run = []
        self._index = {id(s): b for b, members in enumerate(self.buckets) for s in members}
        self._budget = budget


class Schedule:
    """The forward order of one root's units, and the gathers and reductions planned
    from it. `options()` gives the root's UnitOptions (prefetch_depth, bucket budgets:
    the root's settings govern its tree)."""

    def __init__(self, options: Callable):
        self._options = options
        self.forward_order: list = []
        self._position: dict = {}
        self.order = ForwardOrder.RECORDING
        # The budget "auto" stands for (link.py), set once the first backward measured
        # the link (resolve_auto); 0 until then.
        self.auto_bucket_bytes = 0
        self._gathers = BucketPlan(lambda s: s.unit.unsharded_nbytes)
        self._reductions = BucketPlan(_reduce_nbytes)
        # Reduce buckets whose members wait until the last of them is done with backward:
        # bucket index -> the states held so far.
        self.held: dict = {}

    @property
    def recording(self) -> bool:
        return self.order is ForwardOrder.RECORDING

    @property
    def prefetch_depth(self) -> int:
        return self._options().prefetch_depth

    def freeze(self) -> None:
        """The first backward ended: the recorded order is the order from now on."""
        self.order = ForwardOrder.FROZEN

    def record_forward(self, state) -> None:
        if self.recording and state.unit is not None and id(state) not in self._position:
            self._position[id(state)] = len(self.forward_order)
            self.forward_order.append(state)

    def next_in_forward(self, state) -> list:
        i = self._position.get(id(state))
        if self.recording or i is None:
            return []
        return self.forward_order[i + 1: i + 1 + self.prefetch_depth]

    def previous_in_forward(self, state) -> list:
        i = self._position.get(id(state))
        if self.recording or i is None or self.prefetch_depth == 0:
            return []
        return self.forward_order[max(0, i - self.prefetch_depth): i][::-1]

    def first_gathers(self, root) -> list:
        """What start_param_sync launches: the first units of the next forward."""
        return [root] if self.recording else self.forward_order[: 1 + self.prefetch_depth]

    def _bucket(self, plan: BucketPlan, nbytes: int, state) -> Optional[int]:
        """`state`'s bucket in `plan` for a budget of `nbytes`, or None when there are no
        buckets (yet: they follow the order recorded in the first iteration)."""
        if nbytes <= 0 or self.recording:
            return None
        return plan.bucket_of(self.forward_order, state, nbytes)

    def budget(self, name: str) -> int:
        """The root's `name` option (gather_bucket_bytes or reduce_bucket_bytes) in bytes."""
        value = getattr(self._options(), name)
        return self.auto_bucket_bytes if value == AUTO else value

    @property
    def wants_auto(self) -> bool:
        """Whether a bucket option is "auto" and there are units to bucket."""
        o = self._options()
        return AUTO in (o.gather_bucket_bytes, o.reduce_bucket_bytes) and len(self.forward_order) > 1

    def _gather_bucket(self, state) -> Optional[int]:
        return self._bucket(self._gathers, self.budget("gather_bucket_bytes"), state)

    def forward_gathers(self, state) -> Tuple[list, bool]:
        """Units to all-gather in `state`'s pre-forward, and whether they form buckets:
        itself and the prefetch targets; with buckets, the rest of its bucket and the next
        prefetch_depth buckets (members already gathered or in flight cost nothing)."""
        b = None if state.forward_prefetch is not None else self._gather_bucket(state)
        if b is None:
            targets = state.forward_prefetch if state.forward_prefetch is not None else self.next_in_forward(state)
            return [state, *targets], False
        buckets = self._gathers.buckets
        own = buckets[b]
        # Earlier members of its bucket already ran (and may be freed again): not them.
        rest = own[own.index(state):]
        return rest + [s for members in buckets[b + 1: b + 1 + self.prefetch_depth] for s in members], True

    def backward_gathers(self, state) -> Tuple[list, bool]:
        """Units to all-gather in `state`'s pre-backward besides itself (not yet reduced),
        and whether they form buckets: the previous units in forward order, or with
        buckets its bucket and the previous prefetch_depth buckets."""
        b = None if state.backward_prefetch is not None else self._gather_bucket(state)
        if b is None:
            targets = state.backward_prefetch if state.backward_prefetch is not None \
                else self.previous_in_forward(state)
        else:
            targets = [s for members in reversed(self._gathers.buckets[max(0, b - self.prefetch_depth): b + 1])
                       for s in reversed(members) if s is not state]
        return [t for t in targets if t.backward_progress is not BackwardProgress.REDUCED
                and t.options.unshard_in_backward], b is not None

    def hold_for_reduction(self, state) -> Tuple[bool, Optional[list]]:
        """Whether `state`'s gradients wait for its reduce bucket (it is in one of two or
        more members), and the bucket's members to reduce together now if `state` was the
        last of them to finish backward."""
        b = self._bucket(self._reductions, self.budget("reduce_bucket_bytes"), state)
        members = self._reductions.buckets[b] if b is not None else ()
        if len(members) < 2:
            return False, None
        self.held.setdefault(b, []).append(state)
        if all(m.backward_progress is BackwardProgress.REDUCED for m in members):
            return True, self.held.pop(b)
        return True, None

    def take_held(self) -> List[list]:
        """Buckets still held at the end of backward (a member that did not sync), last
        bucket first: the same order on every rank."""
        return [self.held.pop(b) for b in sorted(self.held, reverse=True)]

    def drop_held(self) -> None:
        self.held.clear()
