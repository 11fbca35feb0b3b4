"""torch.amp.GradScaler on a sharded model: an inf in one gradient element lands in one
rank's piece only, yet every rank must skip that step and halve its scale, as one plain
process does and as FSDP2 does (DTensor reduces found_inf across the mesh). FSDP2, ours
and one plain process on the whole batch train side by side: a step whose loss carries a
spike on one bias element (its gradient overflows to inf under the scale) between normal
steps; per step whether the parameters moved, the scale, the loss, and the values at the
end."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from harness import gpu_launch, gpu_world, run_distributed

ROWS, STEPS, SPIKE_AT = 8, 4, 1


class Head(nn.Linear):
    """Its forward also returns its last bias element times 1e35 while `spike` is set: that
    element's gradient overflows to inf under the scale, in one rank's piece."""

    spike = False

    def forward(self, h):
        return super().forward(h), (self.bias[-1] * 1e35 if self.spike else None)


class Spiky(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.out = Head(10, 5)

    def forward(self, x, y):
        logits, spike = self.out(torch.tanh(self.inp(x)))
        loss = F.cross_entropy(logits, y)
        return loss if spike is None else loss + spike


def _dev():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _model(impl: str) -> Spiky:
    torch.manual_seed(0)
    m = Spiky().to(_dev())
    if impl != "plain":
        if impl == "ours":
            from megatron_fsdp_ext import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        fully_shard(m.out)
        fully_shard(m)
    return m


def _train(impl: str) -> dict:
    m = _model(impl)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(_dev().type)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(None) if impl == "plain" else slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    log = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(40 + step)
        x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 5, (ROWS,), generator=g)
        m.out.spike = step == SPIKE_AT
        loss = m(x[rows].to(_dev()), y[rows].to(_dev()))
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in m.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = float(any(not torch.equal(a, p.detach()) for a, p in zip(before, m.parameters())))
        if impl != "plain":  # (moved on any rank, on every rank that holds elements)
            holds = any(p.detach().numel() > 0 for p in m.parameters())
            every = [None] * world
            dist.all_gather_object(every, (moved, holds))
            held = [mv for mv, h in every if h]
            moved = (max(held), min(held))
        else:
            moved = (moved, moved)
        log.append({"moved": moved, "scale": scaler.get_scale()})
    m.out.spike = False
    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 5, (ROWS,), generator=g)
    final = m(x[rows].to(_dev()), y[rows].to(_dev())).detach().double().reshape(1).cpu()
    if impl != "plain":
        final = final.to(_dev())
        dist.all_reduce(final)
        final = final.cpu() / world
    return {"log": log, "final": float(final)}


def _scaler_worker(rank: int, world: int) -> dict:
    out = {impl: _train(impl) for impl in ("plain", "fsdp2", "ours")}
    scales = {impl: [row["scale"] for row in r["log"]] for impl, r in out.items()}
    scale_range = {impl: [] for impl in out}
    for impl in out:  # the scale on every rank
        every = [None] * world
        dist.all_gather_object(every, scales[impl])
        scale_range[impl] = every
    out["scales_by_rank"] = scale_range
    return out


def _check(results) -> None:
    out = results[0]
    plain, fsdp2, ours = out["plain"], out["fsdp2"], out["ours"]
    for step, (p, f, o) in enumerate(zip(plain["log"], fsdp2["log"], ours["log"])):
        expect = 0.0 if step == SPIKE_AT else 1.0
        assert p["moved"] == (expect, expect), (step, p)
        assert f["moved"] == (expect, expect), (step, "FSDP2", f)
        assert o["moved"] == (expect, expect), \
            f"step {step}: ours moved on some ranks {o['moved'][0]}, on every rank {o['moved'][1]}; expected {expect}"
        assert o["scale"] == f["scale"] == p["scale"], (step, o["scale"], f["scale"], p["scale"])
    for impl in ("fsdp2", "ours"):
        every = out["scales_by_rank"][impl]
        assert all(s == every[0] for s in every), f"{impl}: scales differ across ranks: {every}"
    assert plain["log"][SPIKE_AT]["scale"] == plain["log"][SPIKE_AT - 1]["scale"] / 2
    assert abs(ours["final"] - fsdp2["final"]) <= 1e-5 * abs(fsdp2["final"]), (ours["final"], fsdp2["final"])
    assert abs(ours["final"] - plain["final"]) <= 1e-4 * abs(plain["final"]), (ours["final"], plain["final"])


@pytest.mark.parametrize("world", [2, 4])
def test_grad_scaler_skips_an_inf_on_one_rank_on_every_rank(world):
    _check(run_distributed(_scaler_worker, world, timeout=180))


@pytest.mark.gpu
def test_grad_scaler_on_nccl():
    _check(run_distributed(_scaler_worker, gpu_world(), timeout=300, **gpu_launch()))
