"""The default bucket budget, from what the process group's link measures.

A collective over B bytes takes about alpha + B / beta: a fixed cost (launch, the
collective's latency, the stream hand-offs around it) plus the bytes over the link's
bandwidth. A unit whose gather is mostly alpha is latency-bound, and one collective
for several consecutive units pays alpha once. The default budget ("auto") is the
smallest at which alpha is at most LATENCY_SHARE of a full bucket's collective:

    alpha <= s * (alpha + B / beta)   <=>   B >= alpha * beta * (1 - s) / s

so units already that large go alone, and smaller neighbours are coalesced until they
are. alpha and beta come from all-gathers of two sizes timed on the units' group at the
end of the first backward, launched back to back as a step launches them (the slowest
rank's time counts, so every rank plans the same buckets). A link where nothing moves (torch's fake backend) or a world of one gets no
buckets: there is no latency to save.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

AUTO = "auto"
# The share of a bucket's collective time its fixed cost may take.
LATENCY_SHARE = 0.1
# What one bucket may add to the gathered peak, whatever the link measures.
MAX_AUTO_BUCKET_BYTES = 256 << 20
# The probe: all-gathers launched back to back (as a step launches them: no host wait
# in between) of SMALL_PROBE_BYTES, then of sizes growing 4x from LARGE_PROBE_BYTES[0]
# until one takes _MIN_RATIO times the small one's time (bandwidth, not noise, then sets
# the difference) or LARGE_PROBE_BYTES[1] is reached.
SMALL_PROBE_BYTES = 64 << 10
LARGE_PROBE_BYTES = (4 << 20, 64 << 20)
_BATCH = {"small": 16, "large": 4}
_ROUNDS = 3
_MIN_RATIO = 4.0


@dataclass(frozen=True)
class LinkModel:
    """alpha (seconds per collective) and bytes_per_s (all-gather output bytes per
    second); bytes_per_s is inf where nothing moves."""
    alpha_s: float
    bytes_per_s: float

    def __post_init__(self):
        for name in ("alpha_s", "bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"LinkModel.{name} must be a number, got {value!r}")
        if self.alpha_s < 0 or math.isinf(self.alpha_s):
            raise ValueError(f"LinkModel.alpha_s must be finite and >= 0 seconds, got {self.alpha_s!r}")
        if self.bytes_per_s <= 0:
            raise ValueError(f"LinkModel.bytes_per_s must be > 0 (inf: nothing to move), got {self.bytes_per_s!r}")

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s

    @staticmethod
    def fit(small: Tuple[int, float], large: Tuple[int, float]) -> "LinkModel":
        """Through two (bytes, seconds) points; a large one not clearly slower than the
        small one means no measurable bandwidth cost (inf) and the small time is alpha."""
        (b1, t1), (b2, t2) = small, large
        if b2 <= b1:
            raise ValueError(f"LinkModel.fit: the large probe ({b2} bytes) must exceed the small one ({b1})")
        if not (t2 > 1.5 * t1) or t2 <= 0:
            return LinkModel(alpha_s=max(t1, 0.0), bytes_per_s=math.inf)
        beta = (b2 - b1) / (t2 - t1)
        return LinkModel(alpha_s=max(t1 - b1 / beta, 0.0), bytes_per_s=beta)


def auto_bucket_bytes(link: LinkModel) -> int:
    """The budget the module docstring derives, rounded up to a power of two (so that
    small differences between measurements give the same plan), at most
    MAX_AUTO_BUCKET_BYTES; 0 (no buckets) where the link has no measurable bandwidth
    cost or no latency."""
    if math.isinf(link.bytes_per_s) or link.alpha_s <= 0:
        return 0
    needed = link.alpha_s * link.bytes_per_s * (1 - LATENCY_SHARE) / LATENCY_SHARE
    if needed < 1:
        return 0
    return min(1 << math.ceil(math.log2(needed)), MAX_AUTO_BUCKET_BYTES)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# all_gather_single is all_gather_into_tensor's newer name (the old one warns there).
_flat_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    try:
        _flat_all_gather(out, inp, group=group)
    except (RuntimeError, NotImplementedError):  # a backend without the flat all-gather
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), inp, group=group)


def _seconds_per_gather(nbytes: int, count: int, group, device: torch.device) -> float:
    """The slowest rank's median, over _ROUNDS, of `count` back-to-back all-gathers'
    time divided by `count` (output of `nbytes`)."""
    world = dist.get_world_size(group)
    per_rank = max(1, nbytes // world)
    inp = torch.empty(per_rank, dtype=torch.uint8, device=device)
    out = torch.empty(per_rank * world, dtype=torch.uint8, device=device)
    _gather(out, inp, group)  # warm-up: connections, the communicator's buffers
    rounds = []
    for _ in range(_ROUNDS):
        _sync(device)
        start = time.perf_counter()
        for _ in range(count):
            _gather(out, inp, group)
        _sync(device)
        rounds.append((time.perf_counter() - start) / count)
    agreed = torch.tensor([statistics.median(rounds)], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return agreed.item()


def measure_link(group, device: torch.device) -> LinkModel:
    """Fit the link of `group` (tensors on `device`) through a small and a large probe,
    every time the slowest rank's, so every rank gets the same model. Collective: every
    rank of `group` calls it at the same point."""
    if dist.get_backend(group) == "fake":  # every collective returns at once: nothing to time
        return LinkModel(alpha_s=0.0, bytes_per_s=math.inf)
    t_small = _seconds_per_gather(SMALL_PROBE_BYTES, _BATCH["small"], group, device)
    nbytes = LARGE_PROBE_BYTES[0]
    while True:
        t_large = _seconds_per_gather(nbytes, _BATCH["large"], group, device)
        if t_large >= _MIN_RATIO * t_small or nbytes >= LARGE_PROBE_BYTES[1]:
            break
        nbytes *= 4
    return LinkModel.fit((SMALL_PROBE_BYTES, t_small), (nbytes, t_large))
