"""Checkpoint formats: a checkpoint of the flat format (format 1, what save_checkpoint
wrote before it saved torch's state dicts) still loads, at any world size, and what it
loads is exactly what was saved. The fixture under tests/data was written by
save_checkpoint of the last version that wrote the flat format (bd9c576), world 2, and is
kept as bytes, so a change of the reader cannot hide behind a changed writer. It was made
with that version's package first on the path:
    PYTHONPATH=<bd9c576 checkout>/src:tests python3 tests/distributed/test_checkpoint_formats.py
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import megatron_fsdp_ext as mfsdp
from harness import run_distributed
from harness.workers import shard_blocks_and_root
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

CFG = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, ffn_hidden=40)  # two units: the block, the root


def trained(seed: int):
    torch.manual_seed(seed)
    model = shard_blocks_and_root(LlamaModel(LlamaConfig(**CFG)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        tokens = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed + step))
        model.loss(tokens, tokens).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model, opt) -> dict:
    """This rank's shards and optimizer state, by name (no collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, entry in opt.state.items():
        out.update({f"o.{names[id(p)]}.{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
    return out


FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "checkpoint_flat_v1_world2")


def _full_values(model, opt) -> dict:
    """Every parameter and optimizer state value in full (a collective)."""
    values = {f"model.{k}": v for k, v in mfsdp.full_state_dict(model, rank0_only=False).items()}
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            values[f"optimizer.{name}.{key}"] = torch.as_tensor(value).clone()
    return values


def _write_fixture(rank, world, directory):
    """The flat format's writer, inside save_checkpoint's atomic, checksummed save."""
    import megatron_fsdp_ext.dcp as dcp_module

    model, opt = trained(seed=3)
    if hasattr(dcp_module, "FORMAT"):  # a version that writes torch's state dicts: its flat-format writer
        from harness.flat_format import flat_state_dict
        dcp_module.sharded_state_dict = flat_state_dict
    mfsdp.save_checkpoint(os.path.join(directory, "checkpoint"), model, opt)
    values = _full_values(model, opt)
    if rank == 0:
        torch.save(values, os.path.join(directory, "expected.pt"))
    return True


def _load_fixture(rank, world, directory):
    torch.manual_seed(11)
    model = shard_blocks_and_root(LlamaModel(LlamaConfig(**CFG)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mfsdp.load_checkpoint(os.path.join(directory, "checkpoint"), model, opt)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    got = _full_values(model, opt)
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"'{key}' differs from what the flat-format checkpoint holds"
    assert opt.param_groups[0]["lr"] == 1e-2
    # Saved again, now as torch's state dicts, it comes back the same.
    mfsdp.save_checkpoint(os.path.join(directory, f"again_w{world}"), model, opt)
    before = snapshot(model, opt)
    fresh, fresh_opt = trained(seed=5)
    mfsdp.load_checkpoint(os.path.join(directory, f"again_w{world}"), fresh, fresh_opt)
    after = snapshot(fresh, fresh_opt)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flat_format_checkpoint_still_loads(world, tmp_path):
    work = str(tmp_path / "fixture")
    shutil.copytree(FIXTURE, work)
    assert run_distributed(_load_fixture, world, work, timeout=180) == [True] * world


if __name__ == "__main__":
    target = os.path.abspath(FIXTURE)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    assert run_distributed(_write_fixture, 2, target, timeout=180) == [True, True]
    print("wrote", target, sorted(os.listdir(target)))
