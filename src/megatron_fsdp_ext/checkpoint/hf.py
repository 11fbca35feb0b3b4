"""Hugging Face models after fully_shard: the methods that read parameters as a whole.

A sharded PreTrainedModel keeps its class's methods, which see this rank's 1-D shards.
The two that users call on a whole model are overridden on the swapped-in class (only
for classes that define them): `save_pretrained` writes full tensors, and
`num_parameters` counts the full model.
"""
from __future__ import annotations

import torch.distributed as dist

from ..core.extension_points import register_class_overrides
from ..core.param_index import owner_of
from ..core.state_dict import local_state_dict
from .full_state import full_state_dict


def _full_numel(p) -> int:
    state, index = owner_of(p)
    return p.numel() if state is None else state.unit.unsharded_param(index).numel()


def save_pretrained(self, save_directory, *args, state_dict=None, is_main_process=None, **kwargs):
    """Hugging Face's save_pretrained with full tensors. Collective: call it on every
    rank; the parameters are gathered (to CPU, one unit at a time) and global rank 0
    writes (pass is_main_process to choose another writer)."""
    if state_dict is None:  # only the writer keeps the gathered copy
        state_dict = full_state_dict(self, rank0_only=is_main_process is None, cpu_offload=True)
    if is_main_process is None:
        is_main_process = dist.get_rank() == 0
    if not is_main_process:
        return None
    # The writer alone from here: a state_dict() the library's save calls on the model or a
    # submodule (PEFT lists the keys of its modules_to_save so) must not gather. The values
    # it writes are the gathered ones passed in.
    with local_state_dict():
        return super(type(self), self).save_pretrained(save_directory, *args, state_dict=state_dict,
                                                       is_main_process=True, **kwargs)


def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """The full model's count (not this rank's shards), as before fully_shard."""
    import torch.nn as nn

    excluded = set()
    if exclude_embeddings:
        excluded = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
    return sum(_full_numel(p) for p in self.parameters()
               if id(p) not in excluded and (p.requires_grad or not only_trainable))


def overrides_for(cls: type) -> dict:
    """The methods the swapped-in class of `cls` replaces."""
    return {name: fn for name, fn in (("save_pretrained", save_pretrained), ("num_parameters", num_parameters))
            if callable(getattr(cls, name, None))}


register_class_overrides(overrides_for)
