"""A writer of the flat checkpoint format (format 1) that save_checkpoint wrote before it
saved torch's state dicts: the tests write such checkpoints (and forge their entries) to
check that load_checkpoint still reads them, and refuses what it must."""
from __future__ import annotations

import torch.nn as nn

from megatron_fsdp_ext.checkpoint.reader import encode_json
from megatron_fsdp_ext.core.dtensor_face import local_shape
from megatron_fsdp_ext.checkpoint.dcp_flat import model_entries, optimizer_param_names, param_shapes, sharded_param_ranges


def flat_state_dict(module: nn.Module, optimizer=None) -> dict:
    """The format-1 entries of `module` (and `optimizer`): hand them to dcp.save."""
    index, infos = sharded_param_ranges(module)
    sd = model_entries(module, infos)
    sd["meta.param_shapes"] = encode_json({n: list(s) for n, s in param_shapes(infos).items()})
    if optimizer is None:
        return sd
    groups_meta = []
    for g, names in zip(optimizer.param_groups, optimizer_param_names(optimizer, index)):
        groups_meta.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
        for p, name in zip(g["params"], names):
            info = infos.get(id(p))
            for key, value in optimizer.state.get(p, {}).items():
                shard_shaped = info is not None and value.shape == local_shape(p) and value.dim() == 1 \
                    if hasattr(value, "shape") else False
                sd[f"optim.state.{name}.{key}"] = info.wrap(value) if shard_shaped else value
    sd["optim.param_groups"] = encode_json(groups_meta)
    sd["optim.class"] = encode_json({"name": type(optimizer).__qualname__, "module": type(optimizer).__module__})
    return sd
