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

MXFP8 (torchao's MXFP8TrainingOpConfig, whose weights are MXFP8TrainingWeightWrapperTensor:
FSDP2 gathers them in bf16) gets block-aligned shards instead: the unit's layout cuts
shards only on 32-element blocks, so each rank quantizes its own blocks with torchao's
MXTensor.to_mx (local E8M0 scales, no all-reduce), once per shard change, and the gather
carries FP8 data plus one scale byte a block. Forward runs torchao's MXFP8 matmul on the
gathered data without quantizing the weight again; backward runs torchao's own backward
with the weight dequantized from the gathered blocks (torchao quantizes the bf16 weight
along the other dim there; here the FP8 values are quantized again: see docs/design.md).

State dicts, checkpoints and the optimizer see the fp32 master values only.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional, Union

import torch
import torch.nn as nn

from .. import _C
from ..core.extension_points import GatherTransform, register_gather_transform
from ..core.param_index import iter_states

# torchao's attributes of a WeightWithDynamicFloat8CastTensor: not user attributes to copy
# onto the plain parameters that replace it.
_TORCHAO_WEIGHT_ATTRS = frozenset({"_tensor", "_linear_mm_config", "_dtype", "_precomputed_scale"})


@dataclass(frozen=True)
class Fp8Weight:
    """A weight to gather in FP8: its master value, FP8 dtype and torchao's matmul config."""

    master: torch.Tensor
    dtype: torch.dtype
    mm_config: object


@dataclass(frozen=True)
class MXWeight:
    """A weight torchao trains in MXFP8: its master value and torchao's op config."""

    master: torch.Tensor
    config: object


MX_BLOCK = 32  # elements per E8M0 scale (torchao's MXFP8 block)
_TORCHAO_MX_ATTRS = frozenset({"_data", "config"})


def _torchao_type(module_name: str, name: str):
    module = sys.modules.get(module_name)  # imported by whoever converted the model
    return getattr(module, name, None) if module is not None else None


def _is_mx_wrapper(t: torch.Tensor) -> bool:
    kind = _torchao_type("torchao.prototype.moe_training.tensor", "MXFP8TrainingWeightWrapperTensor")
    return kind is not None and isinstance(t, kind)


def fp8_weight(t: torch.Tensor) -> Union[Fp8Weight, MXWeight, None]:
    """`t` as a weight torchao asked to gather in FP8 (tensorwise) or trains in MXFP8,
    else None. torchao's MXFP8 config wraps every parameter of its linear layers; a bias
    (1-D) is gathered in the param dtype (master_of gives its value)."""
    kind = _torchao_type("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")
    if kind is not None and isinstance(t, kind):
        return Fp8Weight(t._tensor, t._dtype, t._linear_mm_config)
    if _is_mx_wrapper(t) and t.dim() >= 2:
        return MXWeight(t._data, t.config)
    return None


def master_of(t: torch.Tensor) -> torch.Tensor:
    """The plain value a unit holds for `t`: the tensor inside torchao's wrappers."""
    w = fp8_weight(t)
    if w is not None:
        return w.master
    return t._data if _is_mx_wrapper(t) else t


def is_fp8_weight(t: torch.Tensor) -> bool:
    return fp8_weight(t) is not None


def alignment_for(alignment: int, weights) -> int:
    """The unit's alignment: MXFP8 weights need shards cut on whole blocks."""
    if any(isinstance(w, MXWeight) for w in weights):
        return alignment * MX_BLOCK // math.gcd(alignment, MX_BLOCK)
    return alignment


def internal_attributes(p: torch.Tensor) -> frozenset:
    """torchao's wrapper attributes on `p`, which are not carried to its replacements."""
    if isinstance(fp8_weight(p), Fp8Weight):
        return _TORCHAO_WEIGHT_ATTRS
    return _TORCHAO_MX_ATTRS if _is_mx_wrapper(p) else frozenset()


def configure(unit, weights: List[Union[Fp8Weight, MXWeight, None]], names: List[str]) -> None:
    """Gathers the unit's FP8 weights in FP8 (Unit.set_fp8_gather) or MXFP8
    (Unit.set_mx_gather); one kind and one FP8 dtype per unit."""
    indices = [i for i, w in enumerate(weights) if w is not None]
    if not indices:
        return
    kinds = {type(weights[i]) for i in indices}
    if len(kinds) > 1:
        raise ValueError(f"fully_shard: one unit holds both tensorwise FP8 and MXFP8 weights ('{names[indices[0]]}' "
                         "and others); shard them in separate units")
    if kinds == {MXWeight}:
        unit.set_mx_gather(indices, MX_BLOCK)
        return
    dtypes = {weights[i].dtype for i in indices}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard: the FP8 weights of one unit must share an FP8 dtype; '{names[indices[0]]}' "
                         f"and others use {sorted(map(str, dtypes))}")
    unit.set_fp8_gather(indices, weights[indices[0]].dtype)


def unsharded_param(unit, index: int, view: torch.Tensor, weight, param_dtype: torch.dtype,
                    requires_grad: bool, scale_views=None) -> nn.Parameter:
    """What forward sees of FP8 weight `index`, made once over the unit's gathered bytes:
    torchao's Float8TrainingTensor with (a view of) the unit's scale for it, or for MXFP8
    an MXGatheredWeight over the gathered data and E8M0 scales."""
    if isinstance(weight, MXWeight):
        return nn.Parameter(MXGatheredWeight(view, scale_views[index], param_dtype, weight.config),
                            requires_grad=requires_grad)
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    t = Float8TrainingTensor(view, unit.fp8_scales[index], param_dtype, weight.mm_config,
                             gemm_input_role=GemmInputRole.WEIGHT)
    return nn.Parameter(t, requires_grad=requires_grad)


def refresh_units(units, only_stale: bool = True) -> None:
    """Bring the FP8 units among `units` up to date with their shards: tensorwise scales
    by one all-reduce(max) per all-gather group (collective: every rank passes the same
    units in the same order); MXFP8 shards quantized locally."""
    fp8_units = [u for u in units if u is not None and u.gathers_bytes]
    mx = [u for u in fp8_units if u.mx_block and (u.fp8_scales_stale or not only_stale)]
    for u in mx:
        quantize_mx_shard(u)
    tensorwise = [u for u in fp8_units if not u.mx_block]
    if tensorwise:
        _C.Unit.refresh_fp8_scales(tensorwise, only_stale)


def _mx_cast_choices():
    """The dim-0 and dim-1 cast kernels torchao's MXFP8 linear uses (mxfp8_linear.py)."""
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice
    return MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA


@torch.no_grad()
def quantize_mx_shard(unit) -> None:
    """This rank's MXFP8 blocks of every MXFP8 weight of `unit`, quantized by torchao's
    MXTensor.to_mx from the param-dtype value (what torchao's forward quantizes after a
    bf16 gather) into the unit's quantized shard: data bytes and one scale byte a block."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    block = unit.mx_block
    data, scales = unit.mx_data, unit.mx_scales
    views = unit.sharded_views()
    dim0, _ = _mx_cast_choices()
    for i, (spec, u) in enumerate(zip(unit.param_specs, unit.unsharded_params)):
        if spec.transform != _C.GatherTransform.MXFP8 or spec.slice.numel == 0:
            continue
        cfg = u._mx_config
        piece = views[i].to(unit.param_dtype).reshape(-1, block)
        mx = MXTensor.to_mx(piece, torch.float8_e4m3fn, block, cfg.scale_calculation_mode, cfg.kernel_preference,
                            mxfp8_dim0_cast_kernel_choice=dim0)
        start, n = spec.slice.shard_offset, spec.slice.numel
        data[start:start + n].copy_(mx.qdata.reshape(-1).view(torch.uint8))
        scales[start // block:(start + n) // block].copy_(mx.scale.reshape(-1).view(torch.uint8))
    unit.mark_quantized()


class MXGatheredWeight(torch.Tensor):
    """What forward sees of an MXFP8 weight: the unit's gathered FP8 data and E8M0 scales
    (views of its buffer). F.linear with it runs torchao's MXFP8 matmul on them, the
    weight not quantized again; any other use raises."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, config):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data, scale, dtype, config):
        self._mx_data, self._mx_scale, self._mx_config = data, scale, config

    def __repr__(self):
        return f"MXGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def mx_tensor(self):
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        return MXTensor(self._mx_data, self._mx_scale.view(torch.float8_e8m0fnu), torch.float8_e4m3fn, MX_BLOCK,
                        self.dtype, self._mx_config.kernel_preference, None, False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "linear" and len(args) >= 2 and isinstance(args[1], cls):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = _MXGatheredLinear.apply(args[0], args[1])
            return out if bias is None else out + bias.to(out.dtype)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default or func is torch.ops.aten.alias.default:
            w = args[0]
            return cls(w._mx_data, w._mx_scale, w.dtype, w._mx_config)
        raise NotImplementedError(f"an MXFP8-gathered weight (megatron_fsdp_ext) supports F.linear only, not {func}")


class _MXGatheredLinear(torch.autograd.Function):
    """y = x @ W^T with x quantized by torchao (dim 0) and W the gathered MXFP8 blocks;
    backward is torchao's mx_mm.backward, given W dequantized from those blocks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: MXGatheredWeight):
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        cfg = weight._mx_config
        dim0, dim1 = _mx_cast_choices()
        x_r = x.reshape(-1, x.shape[-1])
        x_mx = MXTensor.to_mx(x_r, torch.float8_e4m3fn, MX_BLOCK, cfg.scale_calculation_mode, cfg.kernel_preference,
                              mxfp8_dim0_cast_kernel_choice=dim0)
        w_mx = weight.mx_tensor()
        out = torch.mm(x_mx, w_mx.t()).reshape(*x.shape[:-1], -1)
        ctx.save_for_backward(x)
        ctx.w_mx, ctx.cfg = w_mx, cfg
        return out

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm

        (x,) = ctx.saved_tensors
        cfg = ctx.cfg
        dim0, dim1 = _mx_cast_choices()
        weight_hp = ctx.w_mx.dequantize(x.dtype)
        torchao_ctx = SimpleNamespace(
            saved_tensors=(x, weight_hp), in_elem_dtype=torch.float8_e4m3fn, w_elem_dtype=torch.float8_e4m3fn,
            grad_elem_dtype=torch.float8_e4m3fn, block_size=MX_BLOCK, kernel_preference=cfg.kernel_preference,
            mxfp8_dim0_cast_kernel_choice=dim0, mxfp8_dim1_cast_kernel_choice=dim1,
            scale_calculation_mode=cfg.scale_calculation_mode, wgrad_with_hp=cfg.wgrad_with_hp)
        grads = mx_mm.backward(torchao_ctx, grad_output)
        return grads[0], grads[1]


def refresh_fp8_scales(model: nn.Module) -> None:
    """Recompute the FP8 scales of every unit in `model` now (collective). Not needed in
    a training loop: the optimizer step, unshard() and the root's forward do it when the
    shards changed. torchao's precompute_float8_dynamic_scale_for_fsdp finds nothing to
    do on our units (their weights are plain between steps) and can stay in the loop."""
    refresh_units([state.unit for state in iter_states(model)], only_stale=False)


class Fp8GatherTransform(GatherTransform):
    """This module as the core's gather transform (core/extension_points.py)."""

    def weight_of(self, t):
        return fp8_weight(t)

    def master_of(self, t):
        return master_of(t)

    def alignment_for(self, alignment, weights):
        return alignment_for(alignment, weights)

    def configure(self, unit, weights, names):
        configure(unit, weights, names)

    def unsharded_param(self, unit, index, view, weight, param_dtype, requires_grad, scale_views=None):
        return unsharded_param(unit, index, view, weight, param_dtype, requires_grad, scale_views)

    def internal_attributes(self, p):
        return internal_attributes(p)

    def refresh_units(self, units, only_stale=True):
        refresh_units(units, only_stale)


register_gather_transform(Fp8GatherTransform())
