"""ShardedParameter: the class of the parameters `module.parameters()` yields after
fully_shard (this rank's 1-D piece of each parameter, a view of its unit's flat shard).

It exists for one reason: `p.data` hands out a tensor whose in-place writes move no
version counter (that is what `.data` is for), so a unit that keeps a gathered, cast or
quantized copy of its shard (optim / optim_grads / no_shard, a bf16 host copy under
offload, FP8 scales) cannot see `p.data.clamp_(...)` by its versions. FSDP2 sees such
writes because it reads the sharded storage at every gather. Here, handing out `.data`
reports the shard changed (`Unit.shard_changed`, a flag: no communication, no copy), so
the next use gathers, casts and scales again from the shard. A read of `.data` that
writes nothing costs one extra gather of that unit; the hot paths (forward, backward,
torch's optimizers, clipping) never touch `.data`.

Everything else is nn.Parameter's: ops on it return plain tensors, and `p.data = x`
still goes through the unit's own check at the next use (a pointer compare)."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim import optimizer as _torch_optimizer
from torch.utils import _foreach_utils

# Tensor's own `data` attribute (a C getset descriptor), which the property below wraps.
_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]


class ShardedParameter(nn.Parameter):
    """A sharded parameter of a fully_shard unit (see the module docstring)."""

    @property
    def data(self) -> torch.Tensor:
        owner = self.__dict__.get("_mfsdp_owner")
        state = owner() if owner is not None else None
        unit = getattr(state, "unit", None)
        if unit is not None:
            # An overlapped CPU optimizer step may still be writing this shard.
            unit.wait_host_update()
            unit.shard_changed()
        return _TENSOR_DATA.__get__(self, type(self))

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _TENSOR_DATA.__set__(self, value)


# torch's optimizers take their foreach and fused paths, and clip_grad_norm_ its foreach
# path, only for tensor types listed here (DTensor lists itself the same way); unlisted,
# AdamW would update our parameters one tensor at a time.
for _types in (_torch_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if ShardedParameter not in _types:
        _types.append(ShardedParameter)
