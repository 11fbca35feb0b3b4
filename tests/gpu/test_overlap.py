"""Overlap engine on 2 GPUs: profiler-visible overlap and the unsharded-memory bound."""
import os

import pytest

from megatron_fsdp_ext.testing import gpu_world, run_distributed
from megatron_fsdp_ext.testing import workers as W

pytestmark = pytest.mark.gpu
WORLD = gpu_world()


def test_profiler_shows_overlap():
    trace_dir = os.environ.get("MFSDP_TRACE_DIR", "")
    stats = run_distributed(W.overlap_profile, WORLD, 6, trace_dir, backend="nccl", timeout=300)[0]
    print(stats)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_unsharded_memory_independent_of_model_depth(depth):
    peaks = [run_distributed(W.unsharded_memory_bound, WORLD, n, depth, backend="nccl", timeout=300)[0]["peak_unsharded_bytes"]
             for n in (4, 8)]
    assert peaks[0] == peaks[1], f"unsharded peak grows with the number of blocks: {peaks}"


def test_nccl_prefetch_semantics_and_param_sync():
    for depth in (1, 2):
        run_distributed(W.prefetch_semantics, WORLD, depth, backend="nccl", timeout=300)
    for on in (False, True):
        run_distributed(W.param_sync_modes, WORLD, on, backend="nccl", timeout=300)


def test_whole_training_step_in_a_cuda_graph():
    stats = run_distributed(W.cuda_graph_training, WORLD, backend="nccl", timeout=300)[0]
    print(stats)
