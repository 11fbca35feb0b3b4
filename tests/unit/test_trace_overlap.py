"""The overlap measurement of tests/gpu/test_overlap.py (megatron_fsdp_ext.trace),
on synthetic chrome traces whose overlap is known: a prefetching engine and a serial one."""
import json

import pytest

from megatron_fsdp_ext.trace import covered_fraction, kernel_intervals, overlapping, step_overlap

COMPUTE, AG, RS = 7, 17, 21  # stream ids
AG_NAME = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS_NAME = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AR_NAME = "ncclDevKernel_AllReduce_Max_i32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
MARKER = "spin_kernel(long)"


def write_trace(tmp_path, kernels):
    """A torch.profiler-style chrome trace holding `kernels` (name, stream, start_us, end_us)
    and a CPU event that must be ignored."""
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": e - s, "args": {"stream": st}}
              for n, st, s, e in kernels]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5, "args": {}})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return kernel_intervals(str(path))


def prefetching_step(n):
    """One step of root + n blocks as a prefetching engine with separate all-gather and
    reduce-scatter streams runs it. Forward: block i computes while block i+1 gathers;
    backward: block i computes while block i-1 gathers and block i+1 reduce-scatters."""
    k = [("optimizer of the previous step", COMPUTE, -30, -5), (RS_NAME, RS, -50, -40), (MARKER, COMPUTE, 0, 1)]
    k += [(AG_NAME, AG, 2, 10), ("gradient scaling", RS, 2, 10)]  # root: nothing on the compute stream
    k += [("embedding", COMPUTE, 10, 12), (AG_NAME, AG, 10, 18)]  # block 0: a 25% sliver only
    t = 18
    for i in range(n):
        k.append(("block forward", COMPUTE, t, t + 100))
        if i + 1 < n:
            k.append((AG_NAME, AG, t, t + 8))
        t += 100
    k += [("head", COMPUTE, t, t + 20), (MARKER, COMPUTE, t + 20, t + 21)]
    t += 21
    k += [(AG_NAME, AG, t, t + 8), (AG_NAME, AG, t + 8, t + 16), ("block backward", COMPUTE, t + 8, t + 208)]
    t += 208
    for i in range(n - 2, -1, -1):
        k += [("pack", COMPUTE, t, t + 2), (RS_NAME, RS, t + 2, t + 14), ("block backward", COMPUTE, t + 2, t + 202)]
        if i >= 1:
            k.append((AG_NAME, AG, t + 2, t + 10))
        t += 202
    # Block 0's reduce-scatter beside the short embedding backward; the root's alone.
    k += [("pack", COMPUTE, t, t + 2), (RS_NAME, RS, t + 2, t + 14), ("embedding backward", COMPUTE, t + 2, t + 6),
          ("pack", COMPUTE, t + 6, t + 7), (RS_NAME, RS, t + 14, t + 26), (MARKER, COMPUTE, t + 26, t + 27)]
    # Our gradient-flag all-reduce before the root's reduce-scatter: its own kind, not unclassified.
    k.append((AR_NAME, RS, t + 13, t + 14))
    k += [("optimizer", COMPUTE, t + 27, t + 40), (AG_NAME, AG, t + 41, t + 49)]  # the next step: not counted
    return k


def serial_step(n):
    """The same collectives, each one waited for before compute goes on."""
    k = [(MARKER, COMPUTE, 0, 1)]
    t = 1
    for _ in range(n + 1):  # root, then every block: gather, then compute
        k += [(AG_NAME, AG, t, t + 8), ("forward", COMPUTE, t + 8, t + 108)]
        t += 108
    k.append((MARKER, COMPUTE, t, t + 1))
    t += 1
    for _ in range(n):
        k += [(AG_NAME, AG, t, t + 8), ("backward", COMPUTE, t + 8, t + 208), (RS_NAME, RS, t + 208, t + 220)]
        t += 220
    k += [(RS_NAME, RS, t, t + 12), (MARKER, COMPUTE, t + 12, t + 13)]
    return k


def test_prefetching_step_counts_each_overlapped_collective(tmp_path):
    n = 6
    s = step_overlap(write_trace(tmp_path, prefetching_step(n)))
    assert (s["fwd_all_gathers"], s["bwd_all_gathers"], s["reduce_scatters"], s["bwd_all_reduces"],
            s["unclassified_collectives"]) == (n + 1, n, n + 1, 1, 0)
    # Forward: blocks 1..n-1 (the root's gather has no compute beside it, block 0's a sliver).
    assert s["fwd_all_gathers_overlapped"] == n - 1
    assert s["fwd_all_gather_covered_by_compute"][:2] == [0.0, 0.25]
    # Backward: every gather but the last block's; every reduce-scatter but block 0's
    # (5 of 12 us beside compute) and the root's.
    assert s["bwd_all_gathers_overlapped"] == n - 1
    assert s["reduce_scatters_overlapped"] == n - 1
    assert s["reduce_scatter_covered_by_compute"][-2:] == [round(5 / 12, 3), 0.0]
    assert s["bwd_all_gathers_beside_reduce_scatters"] == n - 2
    assert s["fwd_compute_ms"] == pytest.approx((2 + 100 * n + 20) / 1e3)


def test_serial_step_overlaps_nothing(tmp_path):
    n = 6
    s = step_overlap(write_trace(tmp_path, serial_step(n)))
    assert (s["fwd_all_gathers"], s["bwd_all_gathers"], s["reduce_scatters"]) == (n + 1, n, n + 1)
    assert (s["fwd_all_gathers_overlapped"], s["bwd_all_gathers_overlapped"], s["reduce_scatters_overlapped"],
            s["bwd_all_gathers_beside_reduce_scatters"]) == (0, 0, 0, 0)


def test_covered_fraction_merges_and_ignores_its_own_stream():
    gather = (AG_NAME, AG, 0.0, 10.0)
    others = [("a", COMPUTE, 1.0, 5.0), ("b", COMPUTE, 3.0, 7.0), ("cast", AG, 0.0, 10.0), ("c", COMPUTE, 9.0, 30.0)]
    assert covered_fraction(gather, others) == pytest.approx(0.7)
    assert covered_fraction(gather, []) == 0.0
    # A touch at the edges is no overlap; any interior sliver is one for `overlapping`.
    assert not overlapping(gather, [("d", COMPUTE, 10.0, 20.0)])
    assert overlapping(gather, [("e", COMPUTE, 9.9, 20.0)])


def test_step_overlap_needs_three_markers_on_one_stream(tmp_path):
    kernels = prefetching_step(3)
    with pytest.raises(ValueError, match="expected 3 marker kernels"):
        step_overlap(write_trace(tmp_path, kernels[:2] + kernels[3:]))
    moved = [(n, AG if n == MARKER and s == 0 else st, s, e) for n, st, s, e in kernels]
    with pytest.raises(ValueError, match="different streams"):
        step_overlap(write_trace(tmp_path, moved))
