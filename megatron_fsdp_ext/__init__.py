"""megatron_fsdp_ext: Fully Sharded Data Parallel for PyTorch with a C++/CUDA core."""
from __future__ import annotations

__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (fails loudly if the extension was not built)
from .api import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    fully_shard,
)
from .checkpoint import full_state_dict, load_full_state_dict
from .clip import clip_grad_norm_


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
    }


__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "build_info",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "load_full_state_dict",
]
