"""Every public option and method of fully_shard / FSDPModule / clip_grad_norm_ / the
full state dict / FSDPConfig has its effect checked against an independent reference
(workers in tests/harness/option_workers.py). Checks are batched per
topic: each launch of ranks costs time on a 2-core machine."""
import pytest

from harness import gpu_world, run_distributed
from harness import option_workers as OW


def test_alignment_output_dtype_input_cast_config_dtypes_and_fp16_params():
    run_distributed(OW.precision_and_layout_options, 2, timeout=240)


def test_ignored_params_clip_options_and_state_dict_options():
    run_distributed(OW.ignored_params_clip_and_state_dicts, 2, timeout=240)


def test_prefetch_depth_backward_prefetch_reshard_after_forward_and_recurse():
    run_distributed(OW.reshard_and_prefetch_controls, 2, timeout=240)


def test_subgroup_process_group():
    # Also checks the two errors only a subgroup reaches (see test_error_paths.py).
    run_distributed(OW.subgroup_process_group, 4, timeout=300)


@pytest.mark.parametrize("when", ["before_root", "after_root", "symm_mem"])
def test_comm_buffers_from_the_process_group(when):
    # Gloo cannot allocate: the caching allocator stays, one warning names the backend,
    # training is unchanged. On NCCL (tests/gpu) the buffers must lie in the group's pool.
    assert not run_distributed(OW.comm_buffers_from_group, 2, when, timeout=240)[0]["from_group"]


@pytest.mark.gpu
@pytest.mark.parametrize("when", ["before_root", "after_root", "symm_mem"])
def test_nccl_comm_buffers_from_the_process_group(when):
    r = run_distributed(OW.comm_buffers_from_group, gpu_world(), when, backend="nccl", timeout=300)[0]
    # The lent H100/H200s support it: a GPU that does not would test only the fallback.
    assert r["from_group"], "torch's supports_tensor_alloc is false on this GPU: nothing was taken from the group"


@pytest.mark.gpu
def test_nccl_state_dict_options():
    # On CUDA, cpu_offload=False must keep the full state dict on the GPU.
    run_distributed(OW.ignored_params_clip_and_state_dicts, gpu_world(), backend="nccl", timeout=300)
