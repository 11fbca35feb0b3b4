"""FlatLayout math: offsets, alignment, segments and shard slices (no process group)."""
import random

import pytest

from megatron_fsdp_ext import _C


def check_even_layout(numels, world, align):
    layout = _C.FlatLayout.even(numels, world, align)
    offsets = layout.offsets
    # Params are in order, aligned, non-overlapping, inside the buffer.
    end = 0
    for off, n in zip(offsets, numels):
        assert off % align == 0
        assert off >= end
        end = off + n
    assert layout.total_numel >= end
    segs = layout.segment_numels
    assert len(segs) == world and len(set(segs)) == 1
    assert segs[0] % align == 0
    assert layout.total_numel == segs[0] * world
    assert layout.segment_starts == [r * segs[0] for r in range(world)]
    # Every element of every parameter is in exactly one rank's shard, at the right place.
    for i, n in enumerate(numels):
        covered = []
        for r in range(world):
            s = layout.shard_slice(i, r)
            assert 0 <= s.shard_offset and s.shard_offset + s.numel <= segs[r]
            if s.numel:
                # Same flat position seen from the parameter and from the segment.
                assert offsets[i] + s.param_offset == layout.segment_starts[r] + s.shard_offset
                covered.extend(range(s.param_offset, s.param_offset + s.numel))
        assert sorted(covered) == list(range(n))
    covered_total = sum(numels)
    assert layout.has_gaps == (covered_total != layout.total_numel)
    return layout


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("align", [1, 4, 16])
def test_even_layout_random(world, align):
    rng = random.Random(world * 100 + align)
    for _ in range(20):
        numels = [rng.choice([0, 1, 2, 3, 7, 16, 17, 100, 1023]) for _ in range(rng.randint(1, 9))]
        check_even_layout(numels, world, align)




def test_small_param_spread_over_ranks_without_alignment():
    layout = _C.FlatLayout.even([3], 8, 1)
    assert layout.segment_numels == [1] * 8
    assert [layout.shard_slice(0, r).numel for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_zero_size_params_and_offsets():
    layout = check_even_layout([0, 5, 0, 0, 17], 3, 16)
    assert layout.offsets == [0, 0, 16, 16, 16]
    assert layout.total_numel == 48  # 33 elements -> 3 segments of 16


def test_all_zero_size():
    layout = _C.FlatLayout.even([0, 0], 4, 16)
    assert layout.total_numel == 0
    assert all(layout.shard_slice(i, r).numel == 0 for i in range(2) for r in range(4))


def test_world_one_is_identity():
    layout = check_even_layout([10, 7], 1, 4)
    assert layout.segment_starts == [0]
    s = layout.shard_slice(1, 0)
    assert (s.param_offset, s.shard_offset, s.numel) == (0, 12, 7)


def test_alignment_padding_fraction():
    layout = _C.FlatLayout.even([1] * 4, 1, 16)
    assert layout.total_numel == 64
    assert layout.padding_fraction == pytest.approx(60 / 64)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_owner_layout_segments_are_contiguous_and_uneven(world):
    rng = random.Random(world)
    numels = [rng.randint(0, 300) for _ in range(11)]
    owners = [rng.randrange(world) for _ in numels]
    layout = _C.FlatLayout.by_owner(numels, owners, world, 16)
    assert layout.kind == "owner"
    starts, lens = layout.segment_starts, layout.segment_numels
    assert starts[0] == 0
    for r in range(world - 1):
        assert starts[r] + lens[r] == starts[r + 1]
    assert starts[-1] + lens[-1] == layout.total_numel
    for i, n in enumerate(numels):
        r = owners[i]
        assert layout.owner(i) == r
        s = layout.shard_slice(i, r)
        assert s.numel == n and s.param_offset == 0  # wholly on its owner
        for other in range(world):
            if other != r:
                assert layout.shard_slice(i, other).numel == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _C.FlatLayout.even([1], 0, 16), r"world_size must be in \[1, 16777216\], got 0"),
        (lambda: _C.FlatLayout.even([1], 2**40, 16), r"world_size must be in \[1, 16777216\]"),
        (lambda: _C.FlatLayout.even([1], 2, 0), r"alignment must be in \[1, 1048576\], got 0"),
        (lambda: _C.FlatLayout.even([2**55, 2**55], 2, 16), "more than 72057594037927936 elements"),
        (lambda: _C.balance_owners([1.0], 2**40), r"world_size must be in \[1, 16777216\]"),
        (lambda: _C.FlatLayout.even([4, -1], 2, 1), "parameter 1 has negative numel"),
        (lambda: _C.FlatLayout.by_owner([1, 2], [0], 2, 1), "owners has 1 entries for 2 parameters"),
        (lambda: _C.FlatLayout.by_owner([1], [2], 2, 1), "owner 2 outside"),
    ],
)
def test_layout_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def reference_longest_first(costs, world, loads=None):
    """Longest-processing-time greedy, written independently of the C++: costs in
    decreasing order (ties by index), each to the least-loaded rank (ties to the lowest)."""
    loads = list(loads) if loads else [0.0] * world
    owners = [None] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        best = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = best
        loads[best] += costs[i]
    return owners, loads


def test_balance_owners_is_balanced_and_deterministic():
    rng = random.Random(7)
    costs = [float(rng.randint(1, 1000)) for _ in range(50)]
    costs[10] = costs[20] = costs[30]  # equal costs: the tie order must be stable too
    for world in (1, 2, 3, 4, 8):
        owners, loads = _C.balance_owners(costs, world)
        assert (owners, loads) == _C.balance_owners(costs, world)
        assert (owners, loads) == reference_longest_first(costs, world)
        # The returned loads are each rank's summed cost, and they balance: no rank
        # exceeds the mean by more than the largest single cost (the greedy's bound).
        assert loads == pytest.approx([sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)])
        assert max(loads) - sum(costs) / world <= max(costs)


def test_balance_owners_carries_loads_across_buckets():
    # Buckets of two parameters on four ranks: every rank still gets work, and each
    # bucket's returned loads are the previous loads plus that bucket's costs per owner.
    loads, owners = [0.0] * 4, []
    for bucket in ([5.0, 4.0], [5.0, 4.0], [3.0, 3.0]):
        previous = loads
        o, loads = _C.balance_owners(bucket, 4, loads)
        assert (o, loads) == reference_longest_first(bucket, 4, previous)
        added = [sum(c for c, r in zip(bucket, o) if r == rank) for rank in range(4)]
        assert loads == pytest.approx([p + a for p, a in zip(previous, added)])
        owners += o
    # By hand: [5, 4] -> ranks 0, 1; [5, 4] -> the empty ranks 2, 3; [3, 3] -> the two
    # ranks at load 4 (1, then 3).
    assert owners == [0, 1, 2, 3, 1, 3]
    assert loads == [5.0, 7.0, 5.0, 7.0]


def test_balance_owners_bad_input():
    with pytest.raises(ValueError, match="cost of parameter 1"):
        _C.balance_owners([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="world_size"):
        _C.balance_owners([1.0], 0)
    with pytest.raises(ValueError, match="loads has 1 entries for world_size 2"):
        _C.balance_owners([1.0], 2, [0.0])
