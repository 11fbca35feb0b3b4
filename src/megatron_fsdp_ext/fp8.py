"""The FP8 all-gather of torchao's Float8Linear weights (tensorwise recipe).

A model converted with torchao's
``convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
holds its Float8Linear weights as torchao's ``WeightWithDynamicFloat8CastTensor``: the
request to gather them in FP8. FSDP2 serves it through the subclass's
fsdp_pre/post_all_gather hooks; we serve the same request with our own gather transform
(csrc/fp8.h): the unit keeps the plain master value, and

  - after each optimizer step (and before the first forward, or after a load) one
    fused kernel per unit takes the amax of every FP8 weight's piece of the shard and
    one all-reduce(max) for the whole model gives every weight its scale, as torchao's
    precompute_float8_dynamic_scale_for_fsdp computes it;
  - the gather quantizes each piece into the FP8 bytes it all-gathers (half the bytes of
    bf16), the other parameters of the unit riding along in the param dtype;
  - forward sees each weight as torchao's Float8TrainingTensor over the gathered bytes
    and the scale, which Float8Linear uses without casting again. Its bf16 gradient is
    reduced as any other.

State dicts, checkpoints and the optimizer see the fp32 master values only.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn

from . import _C

# torchao's attributes of a WeightWithDynamicFloat8CastTensor: not user attributes to copy
# onto the plain parameters that replace it.
_TORCHAO_WEIGHT_ATTRS = frozenset({"_tensor", "_linear_mm_config", "_dtype", "_precomputed_scale"})


@dataclass(frozen=True)
class Fp8Weight:
    """A weight to gather in FP8: its master value, FP8 dtype and torchao's matmul config."""

    master: torch.Tensor
    dtype: torch.dtype
    mm_config: object


def _torchao_weight_type():
    module = sys.modules.get("torchao.float8.fsdp_utils")  # imported by whoever converted the model
    return getattr(module, "WeightWithDynamicFloat8CastTensor", None) if module is not None else None


def fp8_weight(t: torch.Tensor) -> Optional[Fp8Weight]:
    """`t` as a weight torchao asked to gather in FP8, else None."""
    kind = _torchao_weight_type()
    if kind is None or not isinstance(t, kind):
        return None
    return Fp8Weight(t._tensor, t._dtype, t._linear_mm_config)


def is_fp8_weight(t: torch.Tensor) -> bool:
    return fp8_weight(t) is not None


def user_attributes(p: torch.Tensor) -> dict:
    """The attributes to carry from an original parameter to its sharded and unsharded
    replacements (Megatron markers and the like), without ours or torchao's internals."""
    skip = _TORCHAO_WEIGHT_ATTRS if is_fp8_weight(p) else ()
    return {k: v for k, v in p.__dict__.items()
            if not k.startswith("_mfsdp") and k != "_is_param" and k not in skip}


def configure(unit, weights: List[Optional[Fp8Weight]], names: List[str]) -> None:
    """Gathers the unit's FP8 weights in FP8 (Unit.set_fp8_gather); one FP8 dtype per unit."""
    indices = [i for i, w in enumerate(weights) if w is not None]
    if not indices:
        return
    dtypes = {weights[i].dtype for i in indices}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard: the FP8 weights of one unit must share an FP8 dtype; '{names[indices[0]]}' "
                         f"and others use {sorted(map(str, dtypes))}")
    unit.set_fp8_gather(indices, weights[indices[0]].dtype)


def unsharded_param(unit, index: int, view: torch.Tensor, weight: Fp8Weight, param_dtype: torch.dtype,
                    requires_grad: bool) -> nn.Parameter:
    """What forward sees of FP8 weight `index`: torchao's Float8TrainingTensor over the
    unit's gathered FP8 bytes and (a view of) the unit's scale for it, made once."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    t = Float8TrainingTensor(view, unit.fp8_scales[index], param_dtype, weight.mm_config,
                             gemm_input_role=GemmInputRole.WEIGHT)
    return nn.Parameter(t, requires_grad=requires_grad)


def refresh_units(units, only_stale: bool = True) -> None:
    """Recompute the scales of the FP8 units among `units`: one all-reduce(max) per
    all-gather group. Collective: every rank passes the same units in the same order."""
    fp8_units = [u for u in units if u is not None and u.gathers_bytes]
    if fp8_units:
        _C.Unit.refresh_fp8_scales(fp8_units, only_stale)


def refresh_fp8_scales(model: nn.Module) -> None:
    """Recompute the FP8 scales of every unit in `model` now (collective). Not needed in
    a training loop: the optimizer step, unshard() and the root's forward do it when the
    shards changed. torchao's precompute_float8_dynamic_scale_for_fsdp finds nothing to
    do on our units (their weights are plain between steps) and can stay in the loop."""
    seen, units = set(), []
    for m in model.modules():
        state = m.__dict__.get("_mfsdp_state")
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            units.append(state.unit)
    refresh_units(units, only_stale=False)
