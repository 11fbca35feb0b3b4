"""Drive every entry point of megatron_fsdp_ext._C with wrong arguments.

Run as a script (by test_c_surface.py, in a subprocess): it must finish with exit
code 0. A wrong argument may raise any exception; it must never crash the process.
Usage: python c_surface_fuzz.py [random_iterations] [seed]
"""
from __future__ import annotations

import datetime
import os
import random
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_fsdp_ext import _C

RAISED = 0
TRACE = os.environ.get("MFSDP_FUZZ_TRACE") == "1"


def describe(a):
    """A short description that never reads tensor data (it may be freed)."""
    if isinstance(a, torch.Tensor):
        return f"tensor{tuple(a.shape)}{a.stride()}{a.dtype}"
    if isinstance(a, (list, tuple)):
        return [describe(x) for x in a]
    return a if isinstance(a, (int, float, bool, str, type(None))) else type(a).__name__


def attempt(fn, *args, **kwargs):
    """Call fn; an exception is fine (counted), a crash is not."""
    global RAISED
    if TRACE:
        print("call", getattr(fn, "__name__", "?"), [describe(a) for a in args], flush=True)
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any clear error is acceptable here
        RAISED += 1


def read_all(tensors):
    for t in tensors:
        float(t.float().sum())


def fixed_cases(pg):
    comm = _C.Communicator(pg)
    f = torch.zeros(64)
    expanded = torch.ones(1).expand(64)
    strided = torch.zeros(128)[::2]
    # Collectives: shapes, dtypes, strides, segments.
    for bad in (expanded, strided, torch.zeros(8, 8).t(), torch.zeros(0), torch.zeros(()), torch.zeros(64, dtype=torch.int64)):
        attempt(comm.all_reduce_sum, bad)
        attempt(comm.broadcast, bad, 0)
        attempt(comm.all_gather_flat, bad, f)
        attempt(comm.all_gather_flat, f, bad)
        attempt(comm.reduce_scatter_flat, bad, f)
        attempt(comm.reduce_scatter_flat, f, bad)
        attempt(comm.all_gather_v, bad, f[:8], [0], [8])
        attempt(comm.all_gather_v, f, bad, [0], [64])
        attempt(comm.reduce_scatter_v, f[:8], bad, [0], [8])
    for root in (-1, 1, 2**31):
        attempt(comm.broadcast, f.clone(), root)
    for starts, numels in (([], []), ([0, 0], [1, 1]), ([-1], [1]), ([0], [-1]), ([60], [10]),
                           ([2**62], [2**62]), ([0], [2**63 - 1])):
        attempt(comm.all_gather_v, f, f[:1], starts, numels)
        attempt(comm.reduce_scatter_v, f[:1], f, starts, numels)
    attempt(comm.all_gather_v, f, f[:8], [0], [8], _C.VarAlgo.GROUPED)
    attempt(comm.all_gather_v, f, f[:8], [0], [8], _C.VarAlgo.ALL_REDUCE)
    attempt(_C.Communicator, None)

    # Layouts and the owner balancer.
    for args in (([-1], 1, 16), ([4], 0, 16), ([4], 1, 0), ([2**62, 2**62], 1, 16), ([2**63 - 1], 2, 16),
                 ([4], 2**62, 2**62)):
        attempt(_C.FlatLayout.even, *args)
    for args in (([4], [1], 1, 16), ([4], [-1], 2, 16), ([4, 4], [0], 2, 16), ([2**62, 2**62], [0, 0], 1, 1)):
        attempt(_C.FlatLayout.by_owner, *args)
    layout = _C.FlatLayout.even([3, 5], 2, 4)
    for i, r in ((-1, 0), (2, 0), (0, -1), (0, 2), (2**40, 0)):
        attempt(layout.shard_slice, i, r)
        attempt(layout.owner, i)
    attempt(layout.shard_slices, 5)
    for args in (([1.0, float("nan")], 2), ([-1.0], 2), ([1.0], 0), ([1.0], 2, [0.0]), ([float("inf")], 1)):
        attempt(_C.balance_owners, *args)
    attempt(_C.auto_var_algo, True, True, 10, 5, 0, 4)

    # Packing.
    flat = torch.zeros(32)
    for tensors, offsets in (([torch.ones(4)], [-1]), ([torch.ones(4)], [30]), ([torch.ones(4)], [2**63 - 2]),
                             ([torch.ones(4)], []), ([expanded], [0]), ([strided], [0])):
        attempt(_C.pack_into_flat, flat, tensors, offsets)
        attempt(_C.pack_into_flat, flat, tensors, offsets, True, False)
    attempt(_C.pack_into_flat, torch.zeros(4, 8), [torch.ones(4)], [0])
    attempt(_C.pack_into_flat, strided, [torch.ones(4)], [0])
    attempt(_C.pack_into_flat, torch.zeros(32, dtype=torch.int32), [torch.ones(4)], [0])
    for dst, src in ((flat, torch.ones(31)), (strided, torch.ones(64)), (flat, expanded[:32]), (flat, flat),
                     (torch.zeros(32, dtype=torch.int8), torch.ones(32))):
        attempt(_C.cast_scale_into, dst, src, 0.5)
        attempt(_C.cast_scale_into, dst, src, 0.5, True)

    # CommContext.
    attempt(_C.CommContext, torch.device("cpu"), 0)
    attempt(_C.CommContext, torch.device("cpu"), -5)

    # Units: wrong construction.
    p = torch.randn(6, 4)
    for args in (([], [], pg), ([p], [], pg), ([p], ["a", "b"], pg), ([p, torch.randn(3, dtype=torch.float64)], ["a", "b"], pg),
                 ([torch.ones(3, dtype=torch.int64)], ["a"], pg), ([p], ["a"], pg, 0), ([p], ["a"], pg, -3),
                 ([p], ["a"], pg, 16, torch.int32), ([p], ["a"], pg, 16, None, torch.int64),
                 ([p], ["a"], pg, 16, torch.float8_e4m3fn), ([p], ["a"], pg, 16, None, torch.float8_e5m2),
                 ([p], ["a"], pg, 16, torch.complex64), ([p], ["a"], None)):
        attempt(_C.Unit, *args)

    # Units: calls out of order, on every strategy.
    for strategy in (_C.ShardingStrategy.OPTIM_GRADS_PARAMS, _C.ShardingStrategy.OPTIM_GRADS,
                     _C.ShardingStrategy.OPTIM, _C.ShardingStrategy.NO_SHARD):
        for param_dtype in (None, torch.bfloat16):
            unit = _C.Unit([torch.randn(6, 4), torch.randn(5)], ["w", "b"], pg, 16, param_dtype, None, strategy)
            # Before bind_params and before set_context.
            attempt(unit.unshard)
            attempt(unit.wait_unshard)
            attempt(unit.reduce_grads, True)
            attempt(unit.reduce_grads, False)
            attempt(unit.gather_full_params)
            attempt(unit.gather_full, [None, None], torch.float32)
            attempt(unit.shard_changed, 0, torch.ones(6, 4))
            for index, full in ((-1, torch.ones(6, 4)), (2, torch.ones(5)), (2**40, torch.ones(1)), (0, torch.ones(5)),
                                (1, torch.ones(6, 4)), (0, torch.ones(0))):
                attempt(unit.local_piece, index, full)
            attempt(lambda: [repr(s) for s in unit.param_specs])
            attempt(unit.reshard)
            attempt(unit.set_context, None)
            attempt(unit.set_all_gather_group, None)
            attempt(unit.set_reduce_scatter_group, None)
            views = unit.unsharded_views()
            if _C.freed_storage_guard():
                attempt(read_all, views)  # storage not gathered yet
            attempt(unit.bind_params, [torch.zeros(1)], [])
            attempt(unit.bind_params, unit.sharded_views(), views[:1])
            unit.bind_params([torch.nn.Parameter(v) for v in unit.sharded_views()],
                             [torch.nn.Parameter(v) for v in views])
            attempt(unit.unshard)  # still no context
            attempt(unit.reduce_grads, True)
            unit.set_context(_C.CommContext(torch.device("cpu")))
            unit.unshard()
            unit.wait_unshard()
            kept = unit.unsharded_views()
            unit.reshard()
            if _C.freed_storage_guard():  # without it (older torch) these reads touch freed memory
                attempt(read_all, kept)
                attempt(read_all, views)
                attempt(lambda: kept[0].add_(1))
                attempt(lambda: kept[0].copy_(torch.ones(6, 4)))
                attempt(lambda: torch.cat([kept[0].reshape(-1), kept[1]]))
                attempt(lambda: repr(kept[0]))
                attempt(lambda: kept[0].data_ptr())
            for full in ([torch.ones(6, 4)], [torch.ones(4, 6), torch.ones(5)], [torch.ones(6, 4), torch.ones(5, 1)],
                         [torch.ones(6, 4, dtype=torch.int64), torch.ones(5)], [torch.ones(1).expand(6, 4), torch.ones(5)]):
                attempt(lambda: [unit.shard_changed(i, t) for i, t in enumerate(full)])
            for pieces in ([], [None], [torch.ones(3), None], [torch.ones(10**6), None],
                           [torch.ones(24, dtype=torch.int64), torch.ones(5)], [None, None, None]):
                attempt(unit.gather_full, pieces, torch.float32)
            attempt(unit.gather_full, [None, None], torch.int64)
            # Gradients of the wrong size on the unsharded parameters.
            unit.unshard()
            unit.wait_unshard()
            attempt(unit.reduce_grads, True)


def slot_cases(pg):
    d = {"w": torch.nn.Parameter(torch.ones(2))}
    empty = _C.ParamSlots(None)
    attempt(empty.add, d, "w", 0)  # no unit
    attempt(empty.install, True)
    attempt(empty.use, [None], True)
    attempt(empty.use, [None, None], True)
    attempt(empty.use, [None], False)
    attempt(empty.release, False)
    attempt(_C.ParamSlots)
    attempt(_C.Unit.unshard_all, [None], False)
    attempt(_C.Unit.unshard_all, [None, None], True)
    unit = _C.Unit([torch.randn(2)], ["w"], pg, 4, None, None, _C.ShardingStrategy.OPTIM_GRADS_PARAMS)
    s = _C.ParamSlots(unit)
    s.add(d, "w", 0)
    attempt(s.install, True)  # before bind_params
    attempt(s.install, False)
    attempt(s.use, [unit], False)
    attempt(s.release, False)
    attempt(s.param_index, 5)
    attempt(s.params_dict, -1)
    attempt(s.name, 2**40)
    attempt(s.add, d, "w", 3)  # past the unit's parameters
    attempt(s.add, d, "w", -1)
    attempt(unit.sharded_param, 0)  # nothing bound yet
    attempt(unit.unsharded_param, -1)
    unit.bind_params([torch.nn.Parameter(v) for v in unit.sharded_views()],
                     [torch.nn.Parameter(v) for v in unit.unsharded_views()])
    attempt(s.use, [unit], False)  # no context yet
    unit.set_context(_C.CommContext(torch.device("cpu")))
    attempt(unit.sharded_param, 2**40)
    s2 = _C.ParamSlots(unit)
    s2.add(d, "missing", 0)
    s2.add({}, "w", 0)
    attempt(s2.use, [unit, unit], True)
    attempt(s2.release, True)
    attempt(s2.release, False)
    attempt(s2.use, [unit, None], True)


def random_cases(pg, iterations: int, seed: int):
    rng = random.Random(seed)
    comm = _C.Communicator(pg)

    def value():
        kind = rng.randrange(12)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice([-2**63, -1, 0, 1, 3, 2**31, 2**62, 2**63 - 1])
        if kind == 2:
            return [rng.choice([-1, 0, 1, 7, 2**40]) for _ in range(rng.randrange(4))]
        if kind == 3:
            return torch.randn(rng.randrange(0, 9))
        if kind == 4:
            return torch.randn(rng.randrange(1, 5), rng.randrange(1, 5)).t()
        if kind == 5:
            return torch.ones(1).expand(rng.randrange(1, 9))
        if kind == 6:
            return torch.zeros(rng.randrange(1, 9), dtype=rng.choice([torch.int32, torch.bfloat16, torch.float64]))
        if kind == 7:
            return torch.zeros(16)[:: rng.randrange(1, 4)]
        if kind == 8:
            return rng.choice([True, False, 0.5, float("nan")])
        if kind == 9:
            return rng.choice(list(_C.VarAlgo.__members__.values()))
        if kind == 10:
            return [torch.randn(rng.randrange(0, 5)) for _ in range(rng.randrange(3))]
        return "x"

    unit = _C.Unit([torch.randn(5, 3), torch.randn(7)], ["a", "b"], pg, 4, None, None,
                   _C.ShardingStrategy.OPTIM_GRADS_PARAMS)
    layout = unit.layout
    targets = [
        comm.all_gather_flat, comm.reduce_scatter_flat, comm.all_reduce_sum,
        comm.all_gather_v, comm.reduce_scatter_v, comm.broadcast,
        _C.FlatLayout.even, _C.FlatLayout.by_owner, _C.balance_owners, _C.pack_into_flat, _C.cast_scale_into,
        _C.auto_var_algo, layout.shard_slice, layout.shard_slices, layout.owner,
        unit.bind_params, unit.reduce_grads, unit.set_context, unit.shard_changed,
    ]
    for _ in range(iterations):
        fn = rng.choice(targets)
        args = [value() for _ in range(rng.randrange(0, 6))]
        attempt(fn, *args)


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    fd, init_file = tempfile.mkstemp(prefix="mfsdp_fuzz_")
    os.close(fd)
    os.unlink(init_file)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    fixed_cases(pg)
    slot_cases(pg)
    random_cases(pg, iterations, seed)
    dist.destroy_process_group()
    print(f"fuzz ok: {RAISED} calls raised, none crashed")


if __name__ == "__main__":
    main()
