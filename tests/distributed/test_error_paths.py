"""Every `raise` a user can reach in api.py, config.py, checkpoint.py, dcp.py,
layerwise.py and clip.py is exercised: the exception type and the words of its
message that name the problem. Raise sites covered elsewhere:
  test_errors.py           not-initialized, already sharded, bottom-up order and ties,
                           devices / meta, mp_policy type, non-floating params,
                           MixedPrecisionPolicy fields, groups over other ranks
  test_strategies.py       FSDPConfig fields, fully_shard_model without unit classes or
                           with a non-FSDPConfig, DCP missing / extra keys, shapes, no
                           optimizer state, a partial optimizer
  test_layerwise.py        layer-wise optimizer state missing / unknown names
  test_options.py          clip_grad_norm_(error_if_nonfinite=True); the subgroup-only
                           errors (create_all_gather_group=True and a sharded checkpoint
                           over a subgroup), which need a 4-process spawn
  tests/gpu                parameters on a device the backend cannot carry, or on
                           another CUDA device than the current one
"""
import pytest
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.layerwise import LayerwiseDistributedOptimizer
from harness import run_distributed
from harness.option_workers import error_paths


def test_fully_shard_needs_a_module():
    with pytest.raises(TypeError, match="fully_shard expects an nn.Module, got str"):
        mfsdp.fully_shard("model")


def test_layerwise_optimizer_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"needs torch.distributed.init_process_group\(\) first"):
        LayerwiseDistributedOptimizer(nn.Linear(2, 2), lambda ps: None)


def test_error_paths_world2(tmp_path):
    run_distributed(error_paths, 2, str(tmp_path), timeout=240)
