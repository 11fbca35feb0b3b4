"""Overlap engine on NCCL: overlap per kernel in profiler traces, peak memory read from
the CUDA allocator, prefetch semantics, and a training step captured in a CUDA graph."""
import os

import pytest
import torch

from harness import gpu_launch, gpu_world, run_distributed
from harness import gpu_workers as GW
from harness import workers as W

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)


# Timing: run alone (run_all.sh runs gpu_exclusive tests after the parallel ones), so no
# other test's kernels share the GPUs while the trace is taken.
@pytest.mark.gpu_exclusive
@pytest.mark.nccl_only  # overlap of NCCL kernels with compute; Gloo runs collectives on the host
def test_profiler_shows_overlap_in_a_normal_step():
    trace_dir = os.environ.get("MFSDP_TRACE_DIR", "")
    stats = run_distributed(GW.overlap_profile, WORLD, GW.OVERLAP_BLOCKS, trace_dir, **GPU, timeout=300)[0]
    for name, s in stats.items():
        print(name, {k: v for k, v in s.items() if not isinstance(v, list)})


# NCCL only: Gloo records its own streams on our buffers (recordDataPtrOnStream), so the
# caching allocator hands a freed unit's memory out again only after Gloo's events
# complete: the allocator's peak then holds one more block (measured on 1xH100: 229 vs a
# 142.5 MiB bound). The units' own accounting is bounded on every backend:
# test_unsharded_bytes_bounded_by_prefetch_depth.
@pytest.mark.nccl_only
def test_allocator_peak_memory_bounded_and_independent_of_model_depth():
    results = run_distributed(GW.allocator_memory_bound, WORLD, **GPU, timeout=300)[0]
    for name, r in results.items():
        print(name, {k: f"{v / 2**20:.1f} MiB" for k, v in r.items()})


def test_fully_shard_frees_the_originals_without_the_garbage_collector_gpu():
    """Device memory of the unsharded originals is freed when the units replace them, not
    when the garbage collector next runs (what the held-between-steps bound above reads)."""
    assert run_distributed(W.originals_freed_at_once, WORLD, **GPU, timeout=180)[0]["originals"] > 0


@pytest.mark.long_gpu
def test_unsharded_bytes_bounded_by_prefetch_depth():
    for depth in (0, 1, 2):
        peaks = [run_distributed(W.unsharded_memory_bound, WORLD, n, depth, **GPU, timeout=300)[0]
                 for n in (4, 8)]
        assert peaks[0]["peak_unsharded_bytes"] == peaks[1]["peak_unsharded_bytes"], (depth, peaks)


@pytest.mark.long_gpu
def test_nccl_prefetch_semantics_and_param_sync():
    for depth in (1, 2):
        run_distributed(W.prefetch_semantics, WORLD, depth, **GPU, timeout=300)
    for on in (False, True):
        run_distributed(W.param_sync_modes, WORLD, on, **GPU, timeout=300)


@pytest.mark.parametrize("buckets", [{}, {"gather_bucket_bytes": 1 << 30, "reduce_bucket_bytes": 1 << 30}],
                         ids=["per_unit", "buckets"])
@pytest.mark.nccl_only  # a graph captures device work only; Gloo's collectives wait on the host
def test_whole_training_step_in_a_cuda_graph_matches_plain_pytorch(buckets):
    stats = run_distributed(GW.cuda_graph_training, WORLD, 3, 3, buckets, **GPU, timeout=300)[0]
    print(stats)


@pytest.mark.long_gpu
def test_a_gather_bucket_records_and_waits_once():
    plain = run_distributed(GW.forward_event_calls, WORLD, {}, **GPU, timeout=300)[0]
    one = run_distributed(GW.forward_event_calls, WORLD, {"gather_bucket_bytes": 1 << 30}, **GPU,
                          timeout=300)[0]
    print(plain, one)
    units = plain["units"]
    # Per unit: a done record and a compute-stream wait; bucketed, one of each for all.
    assert one["cudaEventRecord"] <= plain["cudaEventRecord"] - (units - 1), (plain, one)
    assert one["cudaStreamWaitEvent"] <= plain["cudaStreamWaitEvent"] - (units - 1), (plain, one)


@pytest.mark.parametrize("opts", [
    {},
    {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "gather_bucket_bytes": 1 << 30,
     "reduce_bucket_bytes": 1 << 30},
], ids=["fp32", "bf16", "bf16_buckets"])
@pytest.mark.nccl_only  # the guarantee is NCCL's: Gloo stages CUDA tensors through the host
def test_a_training_step_never_waits_on_the_host_for_the_gpu(opts):
    # Raises inside the step (sync debug mode "error") on any host-synchronizing call.
    assert run_distributed(GW.host_synchronizations_in_a_step, WORLD, opts, **GPU, timeout=300)[0] == 2
