"""Watch what fully_shard units do through the library's own profiler scopes.

Every unit opens "mfsdp::unshard[<label>]" when it starts gathering (or casting) its
parameters and "mfsdp::reshard[<label>]" when it frees them. `UnitTrace` records them with
torch.profiler and replays them in the order they started, so tests see gathers, frees and
how many units were unsharded at once without wrapping any library method.
"""
import contextlib
import re
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_SCOPE = re.compile(r"^mfsdp::(unshard|reshard)\[(.*)\]$")
_PHASE = re.compile(r"^test::phase\[(.*)\]$")
_COLLECTIVE = re.compile(r"^mfsdp::(all_gather|reduce_scatter|all_reduce|all_gather_full|all_reduce_replicas|"
                         r"all_gather_post_forward)\[(.*)\]$")


class UnitTrace:
    """Record unshard/reshard events of `states` (FSDPState objects) while in the `with` block.

    `phase(name)` marks a stretch of the test (e.g. "fwd", "bwd"); every event is tagged
    with the innermost marked phase it started in (None outside any). Backward hooks run
    on autograd threads: the profiler follows them there, and phases are matched by time.
    """

    def __init__(self, states: Iterable):
        self.states = list(states)
        self._prof: Optional[profile] = None
        self.initially_unsharded: set = set()
        self.events: List[Tuple[Optional[str], str, object]] = []

    def __enter__(self) -> "UnitTrace":
        self.initially_unsharded = {s for s in self.states if not _is_sharded(s)}
        self._prof = profile(activities=[ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.events = self._replay(recorded_events(self._prof))

    @staticmethod
    @contextlib.contextmanager
    def phase(name: str):
        with record_function(f"test::phase[{name}]"):
            yield

    def _labels(self) -> Dict[str, object]:
        # Read at the end: units take their path in the model as label at lazy init,
        # which may happen inside the traced block.
        by_label = {}
        for s in self.states:
            if s.label in by_label:
                raise ValueError(f"two units share the profiler label {s.label!r}: events would be ambiguous")
            by_label[s.label] = s
        return by_label

    def _replay(self, raw) -> List[Tuple[Optional[str], str, object]]:
        by_label = self._labels()
        phases, scoped = [], []
        for ev in raw:
            m = _PHASE.match(ev.name)
            if m:
                phases.append((ev.start, ev.end, m.group(1)))
                continue
            m = _SCOPE.match(ev.name)
            if m and m.group(2) in by_label:
                scoped.append((ev.start, m.group(1), by_label[m.group(2)]))
        scoped.sort(key=lambda e: e[0])
        if not scoped and self.states:
            # Silence would pass every "at most N" check: a trace with no unit scopes
            # means the profiler saw nothing, not that nothing happened.
            raise AssertionError("the profiler recorded no mfsdp::unshard/reshard scope for any unit")

        def phase_at(t):
            inside = [p for p in phases if p[0] <= t <= p[1]]
            return min(inside, key=lambda p: p[1] - p[0])[2] if inside else None

        return [(phase_at(t), kind, state) for t, kind, state in scoped]

    def unshards(self, phase: Optional[str] = None) -> List:
        """Units in the order they started an unshard (optionally only within `phase`)."""
        return [s for ph, kind, s in self.events if kind == "unshard" and (phase is None or ph == phase)]

    def max_unsharded(self, exclude=(), weight=None) -> Dict[Optional[str], int]:
        """Replay the events: per phase, the most units (or, with `weight(state)`, the most
        summed weight) unsharded at once, not counting `exclude`."""
        weight = weight or (lambda s: 1)
        live = {s for s in self.initially_unsharded if s not in exclude}
        best: Dict[Optional[str], int] = {}
        total = sum(weight(s) for s in live)
        for ph, kind, s in self.events:
            if s in exclude:
                continue
            if kind == "unshard" and s not in live:
                live.add(s)
                total += weight(s)
            elif kind == "reshard" and s in live:
                live.discard(s)
                total -= weight(s)
            best[ph] = max(best.get(ph, 0), total)
        return best


def _is_sharded(state) -> bool:
    return state.unit is None or state.unit.state == state.unit.state.SHARDED


def schedule_buckets(root, names: Dict[int, str]) -> Dict:
    """`root`'s bucket_budgets() (gather, reduce; "auto" resolved) and the gather and
    reduce buckets its schedule cut from the recorded forward order, each unit named by
    names[id(its state)] ("?" where missing). The root must have run a forward."""
    schedule = root._fsdp_state.ctx.schedule

    def named(states) -> List[str]:
        return [names.get(id(st), "?") for st in states]

    return {"budgets": tuple(root.bucket_budgets()), "order": named(schedule.forward_order),
            "gather": [named(b) for b in schedule._gathers.buckets],
            "reduce": [named(b) for b in schedule._reductions.buckets]}


def counting_aot_eager(counts: Dict):
    """A torch.compile backend: aot_eager (no inductor toolchain needed), counting into
    counts["graphs"][who] the graphs it compiles and into counts["calls"][who] the calls
    of their compiled code, `who` being counts["current"] at that moment (the system
    under test)."""

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        who = counts["current"]
        counts["graphs"][who] = counts["graphs"].get(who, 0) + 1
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            who = counts["current"]
            counts["calls"][who] = counts["calls"].get(who, 0) + 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    return backend


@contextlib.contextmanager
def count_collectives():
    """Counts the library's collective scopes ("mfsdp::<collective>[<label>]") issued
    inside the `with` block, per collective kind: e.g. counts["all_reduce_replicas"];
    and under "c10d::<op>" the process group's own dispatcher calls (what a coalesced
    collective must reduce to one). The dict is filled when the block ends."""
    counts: Dict[str, int] = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    for e in recorded_events(prof):
        m = _COLLECTIVE.match(e.name)
        key = m.group(1) if m else e.name if e.name.startswith("c10d::") else None
        if key is not None:
            counts[key] = counts.get(key, 0) + 1


class Event(NamedTuple):
    name: str
    start: int  # ns
    end: int


def recorded_events(prof) -> List[Event]:
    """The events `prof.events()` lists (names and time ranges), read straight from the
    profiler's raw results: prof.events() builds a FunctionEvent (shapes, stacks, memory,
    a tree of every op) for each of the thousands of ops a step records, in Python, which
    took most of the time of the tests that watch units (seconds a step on a 2-core CPU).
    Same selection as torch's: its filtered utility ops and hidden events left out, and
    an event nested in its only-child parent of the same name dropped (EventList's
    _remove_dup_nodes), so counts are those of prof.events()."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None or not hasattr(results, "events"):  # another profiler API: the slow way
        return [Event(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    from torch.autograd.profiler_util import _filter_name

    cpu = torch._C._autograd.DeviceType.CPU
    kept = []  # [name, start, end, thread or None (not part of the CPU tree)]
    for e in results.events():
        name = e.name()
        if _filter_name(name) or getattr(e, "is_hidden_event", lambda: False)():
            continue
        sync_cpu = not (e.is_async() or e.start_thread_id() != e.end_thread_id()) and e.device_type() == cpu
        kept.append([name, e.start_ns(), e.end_ns(), e.start_thread_id() if sync_cpu else None])
    _drop_nested_duplicates(kept)
    return [Event(name, start, end) for name, start, end, _ in kept if name is not None]


def _drop_nested_duplicates(events: List[list]) -> None:
    """EventList._build_tree's parents (per thread, the innermost enclosing interval) and
    _remove_dup_nodes (an event whose parent has the same name and no other child is
    removed, its children going to the parent; repeated until none is): removed events
    get name None."""
    parent: Dict[int, Optional[int]] = {}
    children: Dict[int, List[int]] = {}
    by_thread: Dict[int, List[int]] = {}
    for i, ev in enumerate(events):
        if ev[3] is not None:
            by_thread.setdefault(ev[3], []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i][1], -events[i][2]))
        stack: List[int] = []
        for i in idx:
            start, end = events[i][1], events[i][2]
            while stack:
                top = events[stack[-1]]
                if start >= top[2] or end > top[2]:
                    stack.pop()
                else:
                    break
            parent[i] = stack[-1] if stack else None
            if stack:
                children.setdefault(stack[-1], []).append(i)
            stack.append(i)
    while True:
        gone = [i for i, p in parent.items() if p is not None and events[i][0] is not None
                and events[p][0] == events[i][0] and len(children.get(p, ())) == 1]
        if not gone:
            return
        for i in gone:
            p = parent[i]
            children[p] = children.pop(i, [])
            for c in children[p]:
                parent[c] = p
            events[i][0] = None
            del parent[i]
