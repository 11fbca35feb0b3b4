"""FSDP2's reshard_after_forward=int: between forward and backward a unit keeps 1/N of its
gathered parameters, backward gathers over N consecutive ranks, and training is FSDP2's
with the same int (and ours with True, bit for bit), on a 1-D mesh and on HSDP."""
import pytest

from harness import run_distributed
from harness import post_forward_workers as w


@pytest.mark.parametrize("world, n, hsdp, bucket_bytes", [
    (4, 2, False, 0),
    (4, 2, False, 1 << 30),  # bucketed gathers: a unit gathering from its kept copy goes alone
    (8, 4, False, 0),
    (8, 2, True, 0),         # HSDP 2 x 4, kept over pairs inside each shard group
])
def test_reshard_after_forward_int_trains_like_fsdp2(world, n, hsdp, bucket_bytes):
    assert all(run_distributed(w.trains_like_fsdp2_and_like_true, world, n, hsdp=hsdp, bucket_bytes=bucket_bytes,
                               timeout=300))


def test_reshard_after_forward_int_arguments_read_as_fsdp2_reads_them():
    assert all(run_distributed(w.arguments, 4))


def test_reshard_after_forward_int_on_a_companion_mesh():
    assert all(run_distributed(w.sizes_of_other_meshes, 4))
