"""core/handed_out.py: the watch on a handed-out state-dict value. A value counts as
written only if it changed after it was handed out, whether the caller still holds it or
dropped it (its storage kept until then, the fingerprint telling); a watch that is gone
keeps nothing alive. Single-process: the agreement and write-back around it are tested in
tests/distributed/test_state_dict_writes.py."""
import gc
import os

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_ext.core.handed_out import HandedOutValue, fingerprint


def _dropped_after(write, dtype=torch.float32, n=1000):
    """A watch on a value that `write` changes, then the value dropped."""
    value = torch.randn(n).to(dtype)
    watch = HandedOutValue(value)
    write(value)
    del value
    gc.collect()
    return watch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_a_dropped_value_counts_only_if_written(dtype):
    unwritten = _dropped_after(lambda v: None, dtype)
    assert unwritten() is not None  # its storage is kept until it is settled
    assert HandedOutValue.counts_as_written([unwritten]) == [False]
    one_element = _dropped_after(lambda v: v[7].add_(1), dtype)
    loaded = _dropped_after(lambda v: v.copy_(torch.randn(v.shape).to(dtype)), dtype)
    assert HandedOutValue.counts_as_written([one_element, loaded]) == [True, True]
    assert one_element() is not None and one_element()[7] != 0


def test_the_smallest_change_of_one_element_is_seen():
    """The bit sum is exact: one element moved by one unit in its last place, where a
    floating sum of a thousand values near 1 could not tell."""
    for dtype in (torch.bfloat16, torch.float32):
        value = torch.ones(1000, dtype=dtype)
        watch = HandedOutValue(value)
        value[123] = torch.nextafter(value[123], torch.tensor(2.0, dtype=dtype))
        del value
        gc.collect()
        assert HandedOutValue.counts_as_written([watch]) == [True], dtype


def test_a_value_the_caller_holds_counts_only_once_written():
    """Held values count by their own fingerprint, not by a comparison with the
    parameter (which may have changed on its side since); after a write-back they are in
    step again, and only a new write counts."""
    value = torch.randn(16)
    watch = HandedOutValue(value)
    assert HandedOutValue.counts_as_written([watch]) == [False]
    assert watch() is value and watch.is_of(value)
    value[5] += 1
    assert HandedOutValue.counts_as_written([watch]) == [True]
    watch.resync()
    assert HandedOutValue.counts_as_written([watch]) == [False]
    value.mul_(3)
    assert HandedOutValue.counts_as_written([watch]) == [True]


def test_writes_the_fingerprint_cannot_see_count_by_the_version():
    """Putting back the values handed out (after the parameter changed on its side) and
    permuting them leave both sums as they were: the version counter tells."""
    value = torch.randn(16)
    watch = HandedOutValue(value)
    value.copy_(value.clone())
    assert HandedOutValue.counts_as_written([watch]) == [True]
    value = torch.arange(16.0)
    watch = HandedOutValue(value)
    value.copy_(value.flip(0))
    assert HandedOutValue.counts_as_written([watch]) == [True]
    watch.resync()
    assert HandedOutValue.counts_as_written([watch]) == [False]


def test_nan_values_left_alone_are_not_taken_for_a_write():
    def plant_nan(v):
        v[3] = float("nan")
    value = torch.randn(64)
    value[3] = float("nan")
    watch = HandedOutValue(value)
    del value
    gc.collect()
    assert HandedOutValue.counts_as_written([watch]) == [False]
    assert HandedOutValue.counts_as_written([_dropped_after(plant_nan)]) == [True]


def test_without_a_fingerprint_a_dropped_value_counts_as_written():
    """Non-contiguous values and dtypes without both sums take the exact comparison."""
    assert fingerprint(torch.randn(4, 4).t()) is None
    assert fingerprint(torch.zeros(4, dtype=torch.int64)) is None
    value = torch.randn(4, 4).t()
    watch = HandedOutValue(value)
    del value
    gc.collect()
    assert HandedOutValue.counts_as_written([watch]) == [True]


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def test_the_storage_is_kept_only_while_the_watch_lives():
    """Dropped while watched: the storage stays (one more use) until the watch goes. A
    watch gone first keeps nothing once the caller drops the value."""
    value = torch.randn(256)
    other = value.detach()  # shares the storage, keeps no reference to `value`
    alone = _storage_uses(other)
    watch = HandedOutValue(value)
    del value
    gc.collect()
    assert _storage_uses(other) == alone  # the value's use moved to the kept alias
    del watch
    gc.collect()
    assert _storage_uses(other) == alone - 1
    value = torch.randn(256)
    other = value.detach()
    alone = _storage_uses(other)
    watch = HandedOutValue(value)
    del watch
    gc.collect()
    del value
    gc.collect()
    assert _storage_uses(other) == alone - 1


def test_a_settled_value_is_not_fingerprinted_again():
    watch = _dropped_after(lambda v: v.mul_(2))
    assert HandedOutValue.counts_as_written([watch]) == [True]
    watch._print = None  # a second settle must not read it
    assert HandedOutValue.counts_as_written([watch]) == [True]


def test_a_dtensor_is_rebuilt_around_the_kept_storage():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])
        local_ptr = value.to_local().data_ptr()
        watch = HandedOutValue(value)
        value.to_local().mul_(3)  # what dcp.load does: a copy into the local tensor
        del value
        gc.collect()
        assert HandedOutValue.counts_as_written([watch]) == [True]
        again = watch()
        assert isinstance(again, DTensor) and again.placements == (Shard(0),) and tuple(again.shape) == (6, 3)
        assert again.to_local().data_ptr() == local_ptr
    finally:
        if started:
            dist.destroy_process_group()
