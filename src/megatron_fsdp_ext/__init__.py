"""megatron_fsdp_ext: Fully Sharded Data Parallel for PyTorch with a C++/CUDA core."""
from __future__ import annotations

__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from . import _C  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "megatron_fsdp_ext: the C++ extension megatron_fsdp_ext._C is missing or does not load "
        f"({_err}). Build it with `pip install --no-build-isolation .` (or `-e .` for development, "
        "or `python setup.py build_ext --inplace` with src/ on PYTHONPATH)."
    ) from _err
from .api import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    attach_param_sync,
    fully_shard,
    register_fsdp_forward_method,
)
from .backends import register_backend_capabilities
from .checkpoint import full_state_dict, load_full_state_dict
from .clip import clip_grad_norm_
from .config import FSDPConfig, fully_shard_model
from .dcp import CheckpointError, load_checkpoint, save_checkpoint, sharded_state_dict
from .estimate import MemoryEstimate, estimate_memory
from .fp8 import refresh_fp8_scales
from .materialize import materialize
from .nonfinite import NonFiniteGradientError, check_for_nan_in_grad
from .safetensors_io import load_safetensors
from .state_dict import local_state_dict


def build_info() -> dict:
    """What this installation was built against."""
    import torch

    try:
        from . import _build_info as info
        torch_built = info.TORCH_VERSION
        cuda_built = info.CUDA_VERSION
    except ImportError:  # built by a path that skipped setup.py's generator
        torch_built, cuda_built = None, None
    return {
        "version": __version__,
        "torch_built_against": torch_built,
        "torch_runtime": torch.__version__,
        "cuda_compiled": bool(_C.compiled_with_cuda()),
        "cuda_version_built": cuda_built,
        # Reading a tensor kept from an unsharded parameter after reshard() raises (True)
        # or touches freed memory (False: this torch's StorageImpl cannot refuse access).
        "freed_storage_guard": bool(_C.freed_storage_guard()),
    }


__all__ = [
    "CheckpointError",
    "FSDPConfig",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "attach_param_sync",
    "build_info",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "fully_shard_model",
    "load_checkpoint",
    "load_full_state_dict",
    "load_safetensors",
    "materialize",
    "estimate_memory",
    "MemoryEstimate",
    "NonFiniteGradientError",
    "check_for_nan_in_grad",
    "register_backend_capabilities",
    "refresh_fp8_scales",
    "register_fsdp_forward_method",
    "local_state_dict",
    "save_checkpoint",
    "sharded_state_dict",
]
