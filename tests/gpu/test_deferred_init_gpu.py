"""Deferred init and streamed loading on NCCL: values equal a direct build on the GPU
(CUDA's random number generator), and allocator peaks stay within the local shards plus
one module (materialize), one parameter (broadcast from rank 0) or one slice
(safetensors)."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import init_workers as IW

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()  # MFSDP_GPU_BACKEND: NCCL (a GPU per rank) or Gloo (ranks share a GPU)


@pytest.mark.long_gpu
def test_nccl_materialize_equals_direct_build_and_trains_alike():
    import torch

    for opts in ({}, {"tie": True, "strategy": "optim_grads"},
                 {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}):
        run_distributed(IW.deferred_init_parity, WORLD, opts, **GPU, timeout=300)


def test_nccl_loads_into_meta_model(tmp_path):
    run_distributed(IW.load_into_meta_model, WORLD, {"broadcast": True}, **GPU, timeout=300)
    directory = tmp_path / "hf"
    directory.mkdir()
    run_distributed(IW.load_safetensors_into_meta_model, WORLD, {"tie": True}, str(directory), **GPU,
                    timeout=300)


def test_nccl_deferred_init_and_loading_memory_bounds():
    out = run_distributed(IW.deferred_init_memory, WORLD, **GPU, timeout=300)[0]
    print({k: round(v, 1) for k, v in out.items()})


def test_to_empty_then_initializers_give_one_process_values_gpu():
    """to_empty + torch's initializers on CUDA: the pieces are one plain process's values
    under CUDA's generator (whole-parameter draws), and a step matches it."""
    assert all(run_distributed(IW.to_empty_then_reset_parameters, WORLD, **GPU, timeout=240))


def test_initializers_after_fully_shard_give_one_process_values_gpu():
    """A model built on the GPU, sharded, then initialized (model.apply(init_fn)): the same
    whole-parameter draws under CUDA's generator; the first optimizer step ends the watch."""
    assert all(run_distributed(IW.to_empty_then_reset_parameters, WORLD, "built", **GPU, timeout=240))


@pytest.mark.parametrize("load", ["assign_dtensors", "full_values"])
def test_to_empty_inside_a_unit_then_loading_the_rest_gpu(load):
    """torchtune's first LoRA run on CUDA: to_empty() and initializers on the adapters
    inside a unit built on meta, the base weights loaded alone; one process's values."""
    assert all(run_distributed(IW.to_empty_inside_a_unit_then_load_the_rest, WORLD, load, **GPU, timeout=240))
