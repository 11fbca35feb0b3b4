"""Where the layers above the core plug into it. The core calls what is registered here
and never imports those layers; each layer registers itself when it is imported, and the
package's ``__init__`` imports every layer, so everything is registered before the first
``fully_shard``. With nothing registered the core shards plain tensors.

- **Gather transform**: weights gathered in another format than the parameter dtype
  (precision/fp8.py: torchao's FP8 and MXFP8 weights). One per process.
- **Outer sharding**: parameters already sharded by another parallelism, held by the unit
  as their local shards (parallel/tensor_parallel.py: DTensor TP parameters).
- **Class overrides**: methods the class swapped in by ``fully_shard`` replaces on the
  model's class (checkpoint/hf.py: Hugging Face's ``save_pretrained``, ``num_parameters``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

# Attributes of ours and torch's that are never carried to a parameter's replacements.
_OWN_ATTRIBUTES = ("_is_param",)


class GatherTransform:
    """Plain parameters: gathered in the parameter dtype, nothing to configure."""

    def weight_of(self, t: torch.Tensor):
        """What the transform gathers `t` as (an object it understands), or None."""
        return None

    def master_of(self, t: torch.Tensor) -> torch.Tensor:
        """The plain value a unit holds for `t`."""
        return t

    def alignment_for(self, alignment: int, weights: list) -> int:
        """The unit's shard alignment given the transformed weights."""
        return alignment

    def configure(self, unit, weights: list, names: List[str]) -> None:
        """Tell the C++ unit which parameters it gathers transformed."""

    def unsharded_param(self, unit, index: int, view: torch.Tensor, weight, param_dtype: torch.dtype,
                        requires_grad: bool, scale_views=None) -> torch.nn.Parameter:
        """What forward sees of transformed weight `index` (only called where weight_of gave one)."""
        raise NotImplementedError(f"{type(self).__name__} transforms no weights")

    def internal_attributes(self, p: torch.Tensor) -> tuple:
        """Attributes of `p` that belong to the transform's wrapper, not to the user."""
        return ()

    def refresh_units(self, units, only_stale: bool = True) -> None:
        """Bring transformed copies (scales, quantized shards) up to date with the shards.
        Collective where the transform needs it: every rank passes the same units."""


class OuterSharding:
    """No outer parallelism: every parameter is the whole tensor on this rank."""

    def collect(self, params: list, names: list, mesh) -> Optional[object]:
        """The outer-sharded parameters among `params` (an object with `specs`, a dict from
        parameter index to its spec, and `wrap(index, view, requires_grad)`), or None."""
        return None

    def local_tensors(self, params: list) -> list:
        """What the unit holds of each parameter: its local shard, else itself."""
        return list(params)


_gather_transform = GatherTransform()
_outer_sharding = OuterSharding()
_class_overrides: List[Callable[[type], Dict[str, Callable]]] = []


def _checked(value, kind: type, what: str):
    if not isinstance(value, kind):
        raise TypeError(f"{what}: expected {'an' if kind.__name__[0] in 'AEIOU' else 'a'} {kind.__name__}, "
                        f"got {type(value).__name__}")
    return value


def register_gather_transform(transform: GatherTransform) -> None:
    global _gather_transform
    _gather_transform = _checked(transform, GatherTransform, "register_gather_transform")


def gather_transform() -> GatherTransform:
    return _gather_transform


def register_outer_sharding(sharding: OuterSharding) -> None:
    global _outer_sharding
    _outer_sharding = _checked(sharding, OuterSharding, "register_outer_sharding")


def outer_sharding() -> OuterSharding:
    return _outer_sharding


def register_class_overrides(overrides_for: Callable[[type], Dict[str, Callable]]) -> None:
    """`overrides_for(cls)` gives the methods the swapped-in class of `cls` replaces."""
    if overrides_for not in _class_overrides:
        _class_overrides.append(overrides_for)


def class_overrides(cls: type) -> Dict[str, Callable]:
    methods: Dict[str, Callable] = {}
    for overrides_for in _class_overrides:
        methods.update(overrides_for(cls))
    return methods


def user_attributes(p: torch.Tensor) -> dict:
    """The attributes to carry from an original parameter to its sharded and unsharded
    replacements (Megatron markers and the like), without ours or a transform's internals."""
    skip = _gather_transform.internal_attributes(p)
    return {k: v for k, v in p.__dict__.items()
            if not k.startswith("_mfsdp") and k not in _OWN_ATTRIBUTES and k not in skip}
