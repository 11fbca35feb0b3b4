"""estimate_memory's arithmetic on shapes alone (single process; the distributed test in
tests/distributed/test_hsdp.py compares it with what sharded units really hold)."""
import pytest
import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64, bias=False)  # 4096 elements

    def forward(self, x):
        return self.fc(x)


def _model(frozen: bool = False):
    with torch.device("meta"):
        m = nn.Sequential(Block(), Block(), nn.Linear(64, 10, bias=False))  # root holds 640
    if frozen:
        m[0].fc.weight.requires_grad_(False)
    return m


def test_zero3_counts_segments_root_and_two_largest_units():
    est = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block])
    assert est.num_units == 3 and est.shard_size == 4
    assert est.params == 4 * (1024 + 1024 + 160)
    assert est.grads == est.params and est.optimizer_state == 2 * est.params  # AdamW: exp_avg, exp_avg_sq
    assert est.gathered_params == 4 * (640 + 4096 + 4096)  # root + the unit in use + one prefetched
    assert mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], prefetch_depth=0).gathered_params == \
        4 * (640 + 4096)
    assert est.total == est.params + est.grads + est.optimizer_state + est.gathered_params + est.reduction_buffers
    assert "total, without activations" in str(est)


def test_reshard_after_forward_counts_what_units_keep_until_backward():
    # An int N keeps 1/N of every unit but the root from forward to backward.
    est = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], reshard_after_forward=2)
    assert est.gathered_params == 4 * (640 + 4096 + 4096) + 4 * (4096 + 4096) // 2
    # False keeps them all; the group's size is True; other ints are refused as fully_shard refuses them.
    kept = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], prefetch_depth=0, reshard_after_forward=False)
    assert kept.gathered_params == 4 * (640 + 4096 + 4096)  # not only the unit in use
    assert mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], reshard_after_forward=4).gathered_params == \
        mfsdp.estimate_memory(_model(), 4, unit_modules=[Block]).gathered_params
    with pytest.raises(ValueError, match="reshard_after_forward=3: an int must be a factor"):
        mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], reshard_after_forward=3)


def test_gather_buckets_count_whole_buckets():
    with torch.device("meta"):
        m = nn.Sequential(*[Block() for _ in range(5)], nn.Linear(64, 10, bias=False))
    # Buckets of two blocks (2 x 16 KiB fit 40000 bytes, three do not): the root plus the
    # bucket in use and the prefetched one, i.e. four blocks.
    est = mfsdp.estimate_memory(m, 4, unit_modules=[Block], gather_bucket_bytes=40000)
    assert est.gathered_params == 4 * (640 + 4 * 4096)
    # A budget smaller than a block: one block per bucket, as without buckets.
    assert mfsdp.estimate_memory(m, 4, unit_modules=[Block], gather_bucket_bytes=1).gathered_params == \
        mfsdp.estimate_memory(m, 4, unit_modules=[Block]).gathered_params
    with pytest.raises(ValueError, match="gather_bucket_bytes"):
        mfsdp.estimate_memory(m, 2, gather_bucket_bytes=-1)


def test_reduce_buckets_count_the_largest_bucket():
    with torch.device("meta"):
        m = nn.Sequential(*[Block() for _ in range(5)], nn.Linear(64, 10, bias=False))
    per_unit = mfsdp.estimate_memory(m, 4, unit_modules=[Block])
    assert per_unit.reduction_buffers == 4096 * (4 + 2 * 4)  # a block: its gradient, packed and in flight
    # Packed fp32 gradients: root 2,560 B, blocks 16,384 B. 40,000 bytes hold the root
    # and two blocks, then two blocks twice: the largest bucket is the root's.
    est = mfsdp.estimate_memory(m, 4, unit_modules=[Block], reduce_bucket_bytes=40000)
    assert est.reduction_buffers == (640 + 2 * 4096) * (4 + 2 * 4)
    assert est.gathered_params == per_unit.gathered_params  # gathers are not bucketed by it
    # Strategies that all-reduce full gradients reduce per unit.
    zero1 = dict(unit_modules=[Block], sharding_strategy="optim")
    assert mfsdp.estimate_memory(m, 4, reduce_bucket_bytes=40000, **zero1).reduction_buffers == \
        mfsdp.estimate_memory(m, 4, **zero1).reduction_buffers
    with pytest.raises(ValueError, match="reduce_bucket_bytes"):
        mfsdp.estimate_memory(m, 2, reduce_bucket_bytes=-1)


def test_reduce_buckets_follow_the_forward_order():
    class Wide(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.fc = nn.Linear(64, n, bias=False)

        def forward(self, x):
            return self.fc(x)

    with torch.device("meta"):  # blocks of 1024, 4096, 4096 elements after a root of 640
        m = nn.Sequential(Wide(16), Wide(64), Wide(64), nn.Linear(64, 10, bias=False))
    # Forward order: root 2,560 B, 4,096 B, 16,384 B, 16,384 B of packed gradients; 20,000
    # bytes make [root, small], [big], [big]. Taken backwards, the root would pair with a big one.
    est = mfsdp.estimate_memory(m, 4, unit_modules=[Wide], reduce_bucket_bytes=20000)
    assert est.reduction_buffers == 4096 * (4 + 2 * 4)


def test_strategies_precision_and_frozen_parameters():
    bf16 = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kept = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], sharding_strategy="optim_grads", mp_policy=bf16)
    assert kept.gathered_params == 2 * (640 + 4096 + 4096)  # every unit kept, in bf16
    zero1 = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], sharding_strategy="optim")
    assert zero1.grads == 4 * (640 + 4096 + 4096)  # the full fp32 gradient stays alive behind the shard
    replicated = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], sharding_strategy="no_shard")
    assert replicated.params == 4 * (640 + 4096 + 4096) and replicated.gathered_params == 0  # aliases the shard
    frozen = mfsdp.estimate_memory(_model(frozen=True), 4, unit_modules=[Block], optimizer="sgd")
    assert frozen.grads == 4 * (1024 + 160) and frozen.optimizer_state == 4 * (1024 + 160)


def test_bad_input_is_refused_by_name():
    m = _model()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        mfsdp.estimate_memory(m, 2, optimizer="lion")
    with pytest.raises(ValueError, match="number of ranks must be >= 1"):
        mfsdp.estimate_memory(m, 0)
    with pytest.raises(TypeError, match="DeviceMesh"):
        mfsdp.estimate_memory(m, "8")
    with pytest.raises(ValueError, match="prefetch_depth"):
        mfsdp.estimate_memory(m, 2, prefetch_depth=-1)
    with pytest.raises(TypeError, match="unit_modules must hold nn.Module classes"):
        mfsdp.estimate_memory(m, 2, unit_modules=[m[0]])
    with pytest.raises(ValueError, match="unknown sharding_strategy"):
        mfsdp.estimate_memory(m, 2, sharding_strategy="zero3")


def test_offload_moves_offloaded_units_to_host_bytes():
    base = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block])
    full = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=1.0)
    # Shards, gradients and AdamW state leave the device; the gathered copies do not.
    assert full.params == full.grads == full.optimizer_state == 0
    assert full.gathered_params == base.gathered_params
    seg = 4 * (1024 + 1024 + 160)
    assert full.host_pinned == 2 * seg and full.host_pageable == 2 * seg  # shard + grad; exp_avg + exp_avg_sq
    # Each offloaded unit lands its reduced segment on the device before the copy out.
    assert full.reduction_buffers == base.reduction_buffers + 4 * 1024
    assert "host, pinned" in str(full) and "host, pinned" not in str(base)
    # bf16 gathers over fp32 shards: the bf16 copy the CPU optimizer writes, pinned too.
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bf16 = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=1.0, mp_policy=mp)
    assert bf16.host_pinned == 2 * seg + seg // 2
    unpinned = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=1.0, pin_memory=False)
    assert unpinned.host_pinned == 0 and unpinned.host_pageable == 4 * seg
    # Half: whole units, inner ones first (fully_shard_model's order: the last Block first).
    # (4096 + 4096 + 640 elements: 0.4 of them is reached by one Block, 0.5 needs two.)
    some = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=0.4)
    assert some.params == 4 * (1024 + 160) and some.host_pinned == 2 * 4 * 1024
    half = mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=0.5)
    assert half.params == 4 * 160 and half.host_pinned == 2 * 4 * 2048
    with pytest.raises(ValueError, match=r"offload fraction must be a number in \[0, 1\], got 1.5"):
        mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=1.5)
    with pytest.raises(ValueError, match="offload needs a strategy that reduce-scatters"):
        mfsdp.estimate_memory(_model(), 4, unit_modules=[Block], offload_fraction=1.0, sharding_strategy="no_shard")


def test_offloaded_units_rule():
    from megatron_fsdp_ext.core.options import offloaded_units

    assert offloaded_units([10, 10, 10, 5], 0.0) == [False] * 4
    assert offloaded_units([10, 10, 10, 5], 1.0) == [True] * 4
    assert offloaded_units([10, 10, 10, 5], 0.5) == [True, True, False, False]  # 20 >= 17.5
    assert offloaded_units([10, 10, 10, 5], 0.2) == [True, False, False, False]
    assert offloaded_units([0, 10], 0.5) == [True, True]


class _MoEBlock(nn.Module):
    def __init__(self, experts: int = 8, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.dense = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))


def test_expert_groups_shard_over_the_expert_data_parallel_ranks():
    """Experts split ep ways and sharded over world / ep ranks, a unit of their own; the
    dense part over the whole shard group (what fully_shard builds from torchtitan's
    ShardPlacementResult)."""
    with torch.device("meta"):
        model = nn.Sequential(_MoEBlock(), _MoEBlock())
    routed = {id(p) for b in model for p in (b.w1, b.w2)}
    world, ep = 8, 2
    est = mfsdp.estimate_memory(model, world, unit_modules=[_MoEBlock], optimizer="sgd",
                                experts=lambda p: id(p) in routed, expert_parallel=ep)
    dense, expert = 64 * 64, 2 * 8 * 128 * 64  # per block
    assert est.num_units == 4  # two blocks, each a dense and an expert unit; the root holds nothing
    assert est.params == 2 * 4 * (dense // world + expert // ep // (world // ep))
    assert est.optimizer_state == est.params  # SGD with momentum: one state per element
    plain = mfsdp.estimate_memory(model, world, unit_modules=[_MoEBlock], optimizer="sgd")
    assert plain.params == 2 * 4 * (dense + expert) // world  # without expert parallelism: all over 8
    assert est.params == plain.params  # 1/ep of the experts over world/ep ranks: the same bytes
    # What is gathered shrinks: a rank gathers its own experts only (1/ep of them); the last
    # unit (here the second block's dense part) counts as the root, then the two largest.
    assert est.gathered_params == 4 * (dense + 2 * expert // ep)
    assert plain.gathered_params == 4 * 2 * (dense + expert)
    with pytest.raises(ValueError, match="expert_parallel=3 must divide"):
        mfsdp.estimate_memory(model, world, unit_modules=[_MoEBlock], experts=lambda p: id(p) in routed,
                              expert_parallel=3)
    with pytest.raises(ValueError, match="needs experts="):
        mfsdp.estimate_memory(model, world, unit_modules=[_MoEBlock], expert_parallel=2)
