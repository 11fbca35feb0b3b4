"""What VarAlgo.AUTO picks for uneven collectives (the rule measured in bench_comm)."""
from megatron_fsdp_ext import _C

G, P = _C.VarAlgo.GROUPED, _C.VarAlgo.PADDED
MIN = _C.PADDED_ALL_GATHER_MIN_BYTES


def choose(all_gather=True, grouped=True, total=MIN // 4, longest=None, world=2, element_size=4):
    """grouped: the backend has uneven collective lists (NCCL on CUDA tensors)."""
    longest = total * 2 // 3 if longest is None else longest  # segments 1:2, as measured
    return _C.auto_var_algo(all_gather, grouped, total, longest, world, element_size)


def test_without_uneven_lists_always_padded():
    assert choose(grouped=False, total=10) == P
    assert choose(grouped=False, all_gather=False) == P


def test_reduce_scatter_is_grouped_on_cuda_at_every_size():
    assert choose(all_gather=False, total=10) == G
    assert choose(all_gather=False, total=4 * MIN) == G


def test_all_gather_threshold_is_in_bytes():
    assert choose(total=MIN // 4) == P               # fp32 at the threshold
    assert choose(total=MIN // 4 - 3) == G           # just below it
    assert choose(total=MIN // 4, element_size=2) == G  # same elements in bf16: half the bytes
    assert choose(total=MIN // 2, element_size=2) == P


def test_imbalanced_all_gather_stays_grouped():
    # Padding adds a third at 1:2 (measured); more imbalance pads too much.
    total = 4 * MIN
    assert choose(total=total, longest=total * 2 // 3) == P
    assert choose(total=total, longest=total * 3 // 4) == G
    assert choose(total=total, longest=total, world=4) == G  # one owner holds everything
