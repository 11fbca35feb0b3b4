"""Making ranks agree before they act: every check whose outcome decides which
collectives follow (lazy init, state dicts, checkpoints) must come out the same on every
rank, or the ranks that go on wait forever for the ones that raised.

The pattern: each rank checks locally, one small collective tells everyone what every
rank found, and every rank raises alike, naming the ranks (global ranks) that differ
or failed. Agreement runs it around a block of local steps.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import backends


def rank_world() -> Tuple[int, int]:
    """(global rank, world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj, group=None) -> Dict[int, object]:
    """Every rank's `obj` (picklable) of `group` (None: the whole job), on every rank,
    keyed by global rank in rank order. No collective when the group is this rank alone.
    Under a backend that moves no data (fake) every rank is taken to hold this rank's
    `obj` (said once): what the others hold is not known."""
    if not (dist.is_available() and dist.is_initialized()):
        return {0: obj}
    group_or_world = dist.group.WORLD if group is None else group
    ranks = dist.get_process_group_ranks(group_or_world)
    if len(ranks) == 1:
        return {ranks[0]: obj}
    if not backends.moves_data(group_or_world):
        backends.skipped_without_data("cross-rank agreement (models, checkpoints)", group_or_world)
        return {r: obj for r in ranks}
    out: List[object] = [None] * len(ranks)
    dist.all_gather_object(out, obj, group=group)
    return dict(zip(ranks, out))


def digest(lines: Iterable[str]) -> bytes:
    """32 bytes that differ, but for a hash collision, when `lines` differ."""
    return hashlib.sha256("\0".join(lines).encode()).digest()


def digest_differs(lines: Iterable[str], group, device: torch.device) -> bool:
    """Whether any rank of `group` holds other `lines` than this one: one all-gather of a
    32-byte digest on `device` (the group's backend must reach it). The outcome is the
    same on every rank; no collective when the group is this rank alone."""
    world = dist.get_world_size(group)
    if world == 1:
        return False
    if not backends.moves_data(group, device):
        backends.skipped_without_data("cross-rank agreement (models, checkpoints)", group)
        return False
    raw = digest(lines)
    words = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return not all(torch.equal(d, mine) for d in everyone)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def failures(exc: Optional[BaseException], rank: int) -> Optional[Dict[int, str]]:
    """What failed where, as this rank saw it (None: nothing). DCP gathers every rank's
    exception into one CheckpointException raised on all ranks, which names the ranks
    that really failed."""
    if exc is None:
        return None
    if isinstance(exc, CheckpointException):
        return {r: describe(e) for r, (e, _) in exc.failures.items()}
    return {rank: describe(exc)}


def merged(infos: Iterable[Optional[Dict[int, str]]]) -> Dict[int, str]:
    """The failures() of every rank, as one rank -> description map."""
    failed: Dict[int, str] = {}
    for info in infos:
        failed.update(info or {})
    return failed


def listing(failed: Dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failed.items()))


def raise_agreed(what: str, own: Optional[BaseException], infos: Iterable[Optional[Dict[int, str]]], *,
                 error: type = RuntimeError, tail: str = "") -> None:
    """Raise on every rank if any rank failed (`infos`: every rank's failures()). A rank
    that failed re-raises its own error (its type and message stay those of the check
    that failed; a note names the other failing ranks); the others raise `error` naming
    every failing rank, followed by `tail`."""
    failed = merged(infos)
    if not failed:
        return
    rank = rank_world()[0]
    if own is not None and not isinstance(own, CheckpointException):
        others = {r: m for r, m in failed.items() if r != rank}
        if others:
            own.add_note(f"{what}: also failed on {listing(others)}")
        raise own
    raise error(f"{what}: failed on rank(s) {sorted(failed)}: {listing(failed)}{tail}") from own


class Agreement:
    """The local steps in its block, agreed on by every rank of `group`: a failure on any
    rank raises on every rank, and the ranks go on past the block together or not at all.

        with Agreement("load_checkpoint(ckpt)", error=CheckpointError) as checked:
            ...  # local steps, no collective
        ...      # reached on every rank, or on none

    Collective: every rank of `group` must run the block (an exception that is not an
    Exception, such as KeyboardInterrupt, skips the collective and leaves the others
    waiting). On leaving it, one gather_objects over `group` sends each rank's
    failures() (None when its block finished) and its share; then, on every rank:

    1. `check(shared, group)`, if given, sees every rank's share ({global rank: share})
       and may raise: a disagreement it finds outranks any failure (it sees the same
       shares on every rank, so it raises alike);
    2. if any rank failed: `fail(failed, own)` if given ({global rank: description}, this
       rank's exception or None; it must raise), else raise_agreed: a rank whose block
       failed re-raises its own exception (same object, type and message) with a note
       naming the other failing ranks; the others raise `error` naming every failing
       rank, followed by `tail`. A CheckpointException (DCP has already gathered it on
       every rank) counts for the ranks it names, and becomes `error` on every rank.

    Otherwise every rank goes on past the block, and `shared` holds every rank's share in
    rank order. An exception of the block is never swallowed.

    `share` (picklable): what this rank sends besides its failure; the block may set it
    (`checked.share = ...`); a callable is called on leaving the block, so it reads what
    the block left, also when the block failed. `group`: a process group, None (the whole
    job), or a list of groups agreed on in turn (one gather each, the steps above after
    each; `shared` collects them all). An empty list agrees on nothing: the block's
    exception, if any, propagates on this rank alone. Without torch.distributed, or in a
    group of one rank, there is no collective (nor under a backend that moves no data:
    see gather_objects).
    """

    def __init__(self, what: str, *, group: Union[None, object, Sequence[object]] = None,
                 error: type = RuntimeError, tail: str = "", share: Any = None,
                 check: Optional[Callable[[Dict[int, Any], Any], None]] = None,
                 fail: Optional[Callable[[Dict[int, str], Optional[BaseException]], None]] = None):
        self.what, self.error, self.tail = what, error, tail
        self.groups = list(group) if isinstance(group, (list, tuple)) else [group]
        self.share, self.check, self.fail = share, check, fail
        self.shared: Dict[int, Any] = {}

    def __enter__(self) -> "Agreement":
        return self

    def __exit__(self, kind, own, traceback) -> bool:
        if own is not None and not isinstance(own, (Exception, CheckpointException)):
            return False  # KeyboardInterrupt, SystemExit: not ours to agree on
        share = self.share() if callable(self.share) else self.share
        mine = (failures(own, rank_world()[0]), share)
        for group in self.groups:
            gathered = gather_objects(mine, group)
            shared = {r: s for r, (_, s) in gathered.items()}
            self.shared.update(shared)
            if self.check is not None:
                self.check(shared, group)
            infos = [f for f, _ in gathered.values()]
            failed = merged(infos)
            if failed:
                if self.fail is not None:
                    self.fail(failed, own)
                raise_agreed(self.what, own, infos, error=self.error, tail=self.tail)
        return False  # nothing failed, or no group saw it (no group at all): it raises here
