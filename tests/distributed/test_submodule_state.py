"""State of a module inside a unit that is not a unit itself (`model.inner`, the base
model PEFT's merge_and_unload returns from inside the root's unit): its full state dict
holds the full values of the enclosing unit's parameters too, not this rank's pieces, and
a full state dict loads into it, leaving the rest of that unit as it was; against the
plain module."""
import pytest
import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from harness import run_distributed


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 6)  # the root unit's
        self.block = nn.Linear(6, 6)  # a unit of its own


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.inner.block(self.inner.emb(x)))


def _worker(rank, world, directory):
    torch.manual_seed(0)
    ref = Outer()
    model = Outer()
    model.load_state_dict(ref.state_dict())
    mfsdp.fully_shard(model.inner.block)
    mfsdp.fully_shard(model)
    want = ref.inner.state_dict()
    full = mfsdp.full_state_dict(model.inner, rank0_only=False)
    assert set(full) == set(want), set(full) ^ set(want)
    for k, v in want.items():
        assert torch.equal(full[k], v), k

    # A load into the module writes its parameters only; the head (same unit) keeps its values.
    torch.manual_seed(1)
    other = Inner().state_dict()
    mfsdp.load_full_state_dict(model.inner, other)
    ref.inner.load_state_dict(other)
    after = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        assert torch.equal(after[k], v), k
    with pytest.raises(KeyError, match="missing key"):
        mfsdp.load_full_state_dict(model.inner, {k: v for k, v in other.items() if k != "emb.bias"})

    # Our checkpoint of the module, loaded into a fresh model's: the same values.
    mfsdp.save_checkpoint(directory, model.inner)
    fresh = Outer()
    mfsdp.fully_shard(fresh.inner.block)
    mfsdp.fully_shard(fresh)
    mfsdp.load_checkpoint(directory, fresh.inner)
    loaded = mfsdp.full_state_dict(fresh.inner, rank0_only=False)
    for k, v in other.items():
        assert torch.equal(loaded[k], v), k
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), ref(x))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_state_of_a_module_inside_a_unit(world, tmp_path):
    assert run_distributed(_worker, world, str(tmp_path), timeout=120) == [True] * world
