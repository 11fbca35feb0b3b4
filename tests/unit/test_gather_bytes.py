"""GatherBytes math (csrc/gather_bytes.h): the byte layout of a gather whose parameters
take different widths (FP8 weights beside bf16 norms), checked against a byte-by-byte
model of the layout, without a process group."""
import random

import pytest

from megatron_fsdp_ext import _C


def byte_model(layout, widths):
    """Byte offset of every element position 0..total (inclusive), walking the layout:
    an element takes the width of the parameter whose span [offset_i, offset_next) holds it."""
    order = sorted(range(len(widths)), key=lambda i: layout.offsets[i])
    width_at = [None] * layout.total_numel
    for k, i in enumerate(order):
        end = layout.offsets[order[k + 1]] if k + 1 < len(order) else layout.total_numel
        for pos in range(layout.offsets[i], end):
            width_at[pos] = widths[i]
    first = next((w for w in width_at if w is not None), 1)
    offsets, at = [0], 0
    for w in width_at:
        at += w if w is not None else first
        offsets.append(at)
    return offsets


def check(numels, widths, world, align):
    layout = _C.FlatLayout.even(numels, world, align)
    g = _C.gather_bytes_of(layout, widths)
    model = byte_model(layout, widths)
    assert g.total == model[-1]
    assert g.param_starts == [model[o] for o in layout.offsets]
    # Rank segments tile the buffer in rank order.
    assert g.segment_starts[0] == 0
    for r in range(world):
        s, n = layout.segment_starts[r], layout.segment_numels[r]
        assert g.segment_starts[r] == model[s] and g.segment_bytes[r] == model[s + n] - model[s]
        if r + 1 < world:
            assert g.segment_starts[r + 1] == g.segment_starts[r] + g.segment_bytes[r]
    assert g.segment_starts[-1] + g.segment_bytes[-1] == g.total
    for i, (n, w) in enumerate(zip(numels, widths)):
        start = g.param_starts[i]
        assert start % w == 0, "a gathered copy starts aligned to its dtype"
        if n and align % 16 == 0:
            assert start % 16 == 0
        # Every rank's piece of the parameter lands inside its own bytes, where the
        # parameter's copy expects it: the gathered copy is one contiguous range.
        covered = 0
        for r in range(world):
            sl = layout.shard_slice(i, r)
            if sl.numel == 0:
                continue
            at = start + sl.param_offset * w
            assert at == g.segment_starts[r] + (model[layout.segment_starts[r] + sl.shard_offset]
                                                - model[layout.segment_starts[r]])
            assert at + sl.numel * w <= g.segment_starts[r] + g.segment_bytes[r]
            covered += sl.numel
        assert covered == n
    # Copies do not overlap.
    spans = sorted((g.param_starts[i], g.param_starts[i] + numels[i] * widths[i]) for i in range(len(numels)))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    return g


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_mixed_widths_random(world):
    rng = random.Random(world)
    for _ in range(30):
        k = rng.randint(1, 7)
        numels = [rng.choice([0, 1, 16, 17, 100, 256, 1000]) for _ in range(k)]
        widths = [rng.choice([1, 2, 4]) for _ in range(k)]
        check(numels, widths, world, rng.choice([16, 32]))


def test_fp8_weight_beside_bf16_norms_halves_the_weight_bytes():
    # norm (bf16), weight (fp8), norm (bf16): the weight takes one byte an element.
    g = check([64, 4096, 64], [2, 1, 2], 4, 16)
    assert g.total == 64 * 2 + 4096 + 64 * 2
    assert g.param_starts == [0, 128, 128 + 4096]
    # Unequal contributions: rank 0 holds the first norm (bf16), the others FP8 bytes.
    assert g.segment_bytes == [64 * 2 + 992, 1056, 1056, 992 + 64 * 2]


def test_uniform_width_is_the_layout_scaled():
    layout = _C.FlatLayout.even([10, 33, 7], 3, 16)
    g = _C.gather_bytes_of(layout, [2, 2, 2])
    assert g.param_starts == [2 * o for o in layout.offsets]
    assert g.segment_bytes == [2 * n for n in layout.segment_numels]


def test_bad_widths_are_refused():
    layout = _C.FlatLayout.even([10, 20], 2, 16)
    with pytest.raises(RuntimeError, match="2 widths for 2|1 widths for 2"):
        _C.gather_bytes_of(layout, [1])
    with pytest.raises(RuntimeError, match="positive"):
        _C.gather_bytes_of(layout, [1, 0])
