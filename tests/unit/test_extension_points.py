"""The core's extension points (core/extension_points.py): the layers register when the
package is imported, registrations are checked, and the defaults are plain parameters."""
import pytest
import torch
import torch.nn as nn

import megatron_fsdp_ext  # noqa: F401  (imports every layer: the registrations)
from megatron_fsdp_ext.core import extension_points as ep
from megatron_fsdp_ext.parallel.tensor_parallel import TensorParallelSharding
from megatron_fsdp_ext.precision.fp8 import Fp8GatherTransform


def test_the_layers_are_registered_by_importing_the_package():
    assert type(ep.gather_transform()) is Fp8GatherTransform
    assert type(ep.outer_sharding()) is TensorParallelSharding

    class Pretrained(nn.Module):
        def save_pretrained(self, *a, **k):
            pass

        def num_parameters(self):
            return 0

    assert set(ep.class_overrides(Pretrained)) == {"save_pretrained", "num_parameters"}
    assert ep.class_overrides(nn.Linear) == {}


def test_the_defaults_are_plain_parameters():
    plain, outer = ep.GatherTransform(), ep.OuterSharding()
    p = nn.Parameter(torch.ones(4))
    assert plain.weight_of(p) is None and plain.master_of(p) is p
    assert plain.alignment_for(16, [None]) == 16
    assert plain.internal_attributes(p) == ()
    assert outer.collect([p], ["w"], None) is None and outer.local_tensors([p])[0] is p
    with pytest.raises(NotImplementedError, match="transforms no weights"):
        plain.unsharded_param(None, 0, p, None, torch.float32, True)


def test_registrations_are_checked():
    with pytest.raises(TypeError, match="expected a GatherTransform, got object"):
        ep.register_gather_transform(object())
    with pytest.raises(TypeError, match="expected an OuterSharding, got Fp8GatherTransform"):
        ep.register_outer_sharding(Fp8GatherTransform())


def test_user_attributes_keep_the_users_and_drop_ours():
    p = nn.Parameter(torch.ones(2))
    p.sequence_parallel = True
    p._mfsdp_owner = object()
    assert ep.user_attributes(p) == {"sequence_parallel": True}
