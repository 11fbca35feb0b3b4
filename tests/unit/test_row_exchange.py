"""The plan that moves per-parameter values between our flat layout and FSDP2's rows
(csrc/row_exchange.h), checked by carrying out every rank's plan in one process: each
rank must end with exactly its torch.chunk rows (or, back, its layout piece), every
element sent once, and what p sends q must be what q expects from p."""
import itertools
import random

import pytest
import torch

from megatron_fsdp_ext import _C


def _shapes(rng):
    shapes = []
    for _ in range(rng.randint(1, 6)):
        rows = rng.choice([0, 1, 2, 3, 5, 7, 16, 33])
        shapes.append((rows, rng.choice([1, 3, 4, 8])) if rng.random() < 0.7 else (rows,))
    return shapes


def _run(shapes, world, alignment):
    numels = [int(torch.Size(s).numel()) for s in shapes]
    rows = [s[0] for s in shapes]
    layout = _C.FlatLayout.even(numels, world, alignment)
    fulls = [torch.arange(n, dtype=torch.float64) + 1000 * i for i, n in enumerate(numels)]
    to_rows = [_C.row_exchange_plan(layout, rows, r, True) for r in range(world)]
    # What every rank holds before: its layout piece of each parameter.
    pieces = {(r, i): fulls[i][layout.shard_slice(i, r).param_offset:][:layout.shard_slice(i, r).numel]
              for r in range(world) for i in range(len(shapes))}
    # Carry out the all-to-all: p's send pieces to q, in order, are q's recv pieces from p.
    got = {(r, i): torch.full((_C.row_slice(layout, rows, i, r).numel,), float("nan"), dtype=torch.float64)
           for r in range(world) for i in range(len(shapes))}
    for p, q in itertools.product(range(world), repeat=2):
        sent = [x for x in to_rows[p].send if x.peer == q]
        expected = [x for x in to_rows[q].recv if x.peer == p]
        assert [(x.param, x.numel) for x in sent] == [(x.param, x.numel) for x in expected]
        assert to_rows[p].send_splits[q] == to_rows[q].recv_splits[p] == sum(x.numel for x in sent)
        for s, e in zip(sent, expected):
            got[q, e.param][e.dst_offset:e.dst_offset + e.numel] = pieces[p, s.param][s.src_offset:s.src_offset + s.numel]
    for (r, i), value in got.items():
        chunk = torch.chunk(fulls[i].view(shapes[i]), world)[r] if shapes[i][0] and r < len(
            torch.chunk(fulls[i].view(shapes[i]), world)) else fulls[i][:0]
        assert torch.equal(value, chunk.reshape(-1)), (shapes, world, r, i)
    # And back: the rows give every rank its layout piece again.
    back = [_C.row_exchange_plan(layout, rows, r, False) for r in range(world)]
    out = {k: torch.full_like(v, float("nan")) for k, v in pieces.items()}
    for p, q in itertools.product(range(world), repeat=2):
        sent = [x for x in back[p].send if x.peer == q]
        expected = [x for x in back[q].recv if x.peer == p]
        for s, e in zip(sent, expected):
            out[q, e.param][e.dst_offset:e.dst_offset + e.numel] = got[p, s.param][s.src_offset:s.src_offset + s.numel]
    for k in pieces:
        assert torch.equal(out[k], pieces[k]), (shapes, world, k)


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_round_trip(seed):
    rng = random.Random(seed)
    _run(_shapes(rng), rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 4, 16]))


def test_every_element_moves_once():
    shapes, world = [(33, 8), (7,), (16, 4)], 4
    layout = _C.FlatLayout.even([264, 7, 64], world, 16)
    plans = [_C.row_exchange_plan(layout, [33, 7, 16], r, True) for r in range(world)]
    assert sum(sum(p.send_splits) for p in plans) == 264 + 7 + 64  # not world times the unit
    one = _C.row_exchange_plan(layout, [33, 7, 16], 1, True, only=2)
    assert {x.param for x in one.send + one.recv} <= {2}


def test_torch_chunk_rows():
    for rows in range(0, 12):
        for world in range(1, 6):
            sizes = [len(c) for c in torch.chunk(torch.arange(rows), world)] if rows else []
            got = [_C.chunk_rows(rows, world, r) for r in range(world)]
            assert [e - b for b, e in got] == sizes + [0] * (world - len(sizes)), (rows, world)
            assert all(b == (got[r - 1][1] if r else 0) for r, (b, _) in enumerate(got)), (rows, world)
    assert _C.row_slice(_C.FlatLayout.even([12], 5, 1), [6], 0, 4).numel == 0  # torch.chunk(6, 5): 3 chunks of 2
    with pytest.raises(ValueError, match="does not split into 5 rows"):
        _C.row_slice(_C.FlatLayout.even([12], 2, 1), [5], 0, 0)
