"""megatron_fsdp_ext: Fully Sharded Data Parallel for PyTorch with a C++/CUDA core."""
__version__ = "0.1.0"

import torch as _torch  # noqa: F401  (loads libtorch before the extension)

try:
    from . import _C  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "megatron_fsdp_ext: the C++ extension megatron_fsdp_ext._C is missing or does not load "
        f"({_err}). Build it with `pip install --no-build-isolation .` (or `-e .` for development, "
        "or `python setup.py build_ext --inplace` with src/ on PYTHONPATH)."
    ) from _err
import atexit as _atexit
import gc as _gc
import sys as _sys

from .core.api import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    attach_param_sync,
    fully_shard,
    register_fsdp_forward_method,
)
from .core.backends import register_backend_capabilities
from .core.nonfinite import NonFiniteGradientError, check_for_nan_in_grad
from .core.state_dict import local_state_dict

# The layers above the core register with it as they are imported (core/extension_points.py):
# importing them all here puts every registration in place before any fully_shard.
from . import optim  # noqa: E402  (the CPU optimizers: megatron_fsdp_ext.optim)
from .checkpoint import dcp, hf  # noqa: F401  (hf: Hugging Face method overrides)
from .checkpoint.dcp import CheckpointError, load_checkpoint, save_checkpoint, sharded_state_dict
from .checkpoint.full_state import full_state_dict, load_full_state_dict
from .checkpoint.safetensors_io import load_safetensors
from .core import backends, link
from .parallel import layerwise, tensor_parallel  # noqa: F401  (tensor_parallel: DTensor TP parameters)
from .precision.fp8 import refresh_fp8_scales
from .tools import trace
from .tools.clip import clip_grad_norm_
from .tools.config import FSDPConfig, fully_shard_model
from .tools.estimate import MemoryEstimate, estimate_memory
from .tools.materialize import materialize

# Sharded modules sit in reference cycles (module <-> unit state) that hold process groups.
# Left to the interpreter's shutdown, a Gloo group freed there joins worker threads that
# may still need the GIL, which a finalizing interpreter no longer grants: the process
# aborts ("terminate called without an active exception"), a failed job to torchrun.
# Collected at exit, while the interpreter is whole, the groups close normally.
_atexit.register(_gc.collect)

# The public modules keep their flat paths (import megatron_fsdp_ext.dcp, from
# megatron_fsdp_ext.link import LinkModel): each is the layer's module under a second name,
# one object, so patches and isinstance checks agree.
for _public in (backends, dcp, layerwise, link, trace):
    _sys.modules[f"{__name__}.{_public.__name__.rsplit('.', 1)[1]}"] = _public
del _public


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
