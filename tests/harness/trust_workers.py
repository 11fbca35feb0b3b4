"""Checkpoints as an attacker hands them over: pickles that run code, fuzzed bytes with a
manifest recomputed to match (the manifest proves completeness, not trust)."""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from typing import Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.checkpoint.files import MANIFEST_NAME, digest_ranges, entry_ranges, whole_file_record
from megatron_fsdp_ext.checkpoint.reader import read_metadata_file
from megatron_fsdp_ext.dcp import sharded_state_dict

from .flat_format import flat_state_dict
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

from .workers import expect_error, shard_blocks_and_root

CFG = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, ffn_hidden=40)  # two units: the block, the root


class Opens:
    """Unpickling this opens (creates) the file `marker`: code run from a checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def reseal(path: str) -> None:
    """Rewrite the manifest so that every file matches it again, as an attacker who edited
    the files would: .metadata's sha256 and size; each data file's size, and the sha256 of
    each of its ranges (the entries the current .metadata places in it, else those the
    manifest listed, cut to the file as it is now, with the gaps as ranges of their own)."""
    where = os.path.join(path, MANIFEST_NAME)
    with open(where) as f:
        manifest = json.load(f)
    try:
        storage = read_metadata_file(os.path.join(path, ".metadata")).storage_data
        placed = {}
        for info in storage.values():
            placed.setdefault(info.relative_path, set()).add((info.offset, info.length))
    except Exception:  # noqa: BLE001 - a garbled .metadata: the ranges the manifest listed
        placed = None
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == MANIFEST_NAME or not os.path.isfile(full):
            continue
        if name == ".metadata":
            files[name] = whole_file_record(full)
            continue
        size = os.path.getsize(full)
        if placed is not None and name in placed:
            entries = placed[name]
        else:
            entries = {(o, n) for o, n, _ in manifest["files"].get(name, {}).get("entries", [])}
        ranges, cursor = [], 0
        for offset, length in sorted(entries):  # cut to the file; overlaps dropped
            offset, end = max(offset, cursor), min(offset + length, size)
            if end > offset:
                ranges.append((offset, end - offset))
                cursor = end
        files[name] = {"size": size, "entries": digest_ranges(full, entry_ranges(name, size, ranges))}
    manifest["files"] = files
    with open(where, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = shard_blocks_and_root(LlamaModel(LlamaConfig(**CFG)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    model.loss(tokens, tokens).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def snapshot(model, opt) -> Dict[str, torch.Tensor]:
    """This rank's shards and optimizer state, by name (no collective)."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"o.{names[id(p)]}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _barrier_then(rank: int, fn) -> None:
    if rank == 0:
        fn()
    dist.barrier()


def pickle_attacks(rank: int, world: int, path: str) -> None:
    """Both attacks of the issue fail to run code and give a clear error: DCP's .metadata
    replaced by a pickle that opens a file, and one of our metadata entries replaced by
    one (both in the new format and as the earlier pickled format), the manifest
    recomputed each time. torch's own reader does run the .metadata payload (the attack is
    live)."""
    model, opt = trained()
    mfsdp.save_checkpoint(f"{path}/good", model, opt)

    # 1. DCP's .metadata.
    marker = f"{path}/ran_metadata"
    bad = f"{path}/bad_metadata"

    def forge_metadata():
        shutil.copytree(f"{path}/good", bad)
        with open(f"{bad}/.metadata", "wb") as f:
            pickle.dump(Opens(marker), f)
        reseal(bad)

    _barrier_then(rank, forge_metadata)
    expect_error(lambda: mfsdp.load_checkpoint(bad, model, opt), mfsdp.CheckpointError, ".metadata",
                 "refuses to load class", "open")
    dist.barrier()
    assert not os.path.exists(marker), "loading the forged .metadata ran its code"

    # 2. Our metadata entry, written by DCP itself (torch.save of an object), and as the
    # earlier format's pickled bytes.
    # The same in the flat format's metadata entry.
    for name, value, key, entries in (
            ("new", Opens(f"{path}/ran_entry_new"), "meta.format", sharded_state_dict),
            ("legacy", pickle.dumps(Opens(f"{path}/ran_entry_legacy")), "meta.format", sharded_state_dict),
            ("flat_new", Opens(f"{path}/ran_entry_flat_new"), "meta.param_shapes", flat_state_dict),
            ("flat_legacy", pickle.dumps(Opens(f"{path}/ran_entry_flat_legacy")), "meta.param_shapes", flat_state_dict)):
        forged = f"{path}/bad_entry_{name}"
        sd = entries(model, opt)
        sd[key] = value
        dcp.save(sd, checkpoint_id=forged)
        if rank == 0:
            shutil.copy(f"{path}/good/{MANIFEST_NAME}", forged)
            reseal(forged)
        dist.barrier()
        expect_error(lambda: mfsdp.load_checkpoint(forged, model, opt), mfsdp.CheckpointError, key)
        dist.barrier()
        assert not os.path.exists(f"{path}/ran_entry_{name}"), f"loading the forged entry ({name}) ran its code"
    # The model still holds what it trained to (nothing was loaded).
    fresh = snapshot(model, opt)
    mfsdp.load_checkpoint(f"{path}/good", model, opt)
    assert same(snapshot(model, opt), fresh)

    # Control: torch's own reader runs the .metadata payload.
    if rank == 0:
        try:
            dcp.FileSystemReader(bad).read_metadata()
        except Exception:
            pass
        assert os.path.exists(marker), "torch's reader did not run the payload: the attack above proves nothing"


def _mutate(data: bytes, rng: random.Random):
    """(new bytes, what was done): 1-4 flipped bytes, or a truncation."""
    if rng.random() < 0.25 or len(data) < 2:
        cut = rng.randrange(0, max(1, len(data)))
        return data[:cut], f"truncated to {cut} of {len(data)} bytes"
    out = bytearray(data)
    where = sorted(rng.randrange(len(out)) for _ in range(rng.randint(1, 4)))
    for i in where:
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out), f"bits flipped at {where}"


def fuzz_checkpoint(rank: int, world: int, path: str, cases: int, seed: int) -> Dict:
    """`cases` corrupted copies of a checkpoint (each file in turn: bytes flipped or the
    file truncated; the manifest recomputed so the hash check passes), each loaded on
    every rank. Each load must either give exactly the saved values or raise an error
    that names the corrupted file (the directory alone for .metadata-derived checks is
    not enough: the file is named); a failed load leaves the model and optimizer as they
    were. Counts per outcome, and any case that did neither."""
    model, opt = trained(seed=1)
    mfsdp.save_checkpoint(f"{path}/good", model, opt)
    saved = snapshot(model, opt)
    target, target_opt = trained(seed=2)
    before = snapshot(target, target_opt)
    files = sorted(n for n in os.listdir(f"{path}/good") if n != MANIFEST_NAME)
    rng = random.Random(seed)
    counts = {"equal": 0, "error_naming_file": 0}
    bad_cases = []
    for case in range(cases):
        name = files[case % len(files)]
        work = f"{path}/case"
        info = [None]
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(f"{path}/good", work)
            with open(f"{work}/{name}", "rb") as f:
                data, what = _mutate(f.read(), rng)
            with open(f"{work}/{name}", "wb") as f:
                f.write(data)
            reseal(work)
            info[0] = what
        dist.broadcast_object_list(info, src=0)
        try:
            mfsdp.load_checkpoint(work, target, target_opt)
        except Exception as e:  # noqa: BLE001 - every error is classified below
            text = f"{type(e).__name__}: {e}"
            if name in text:
                counts["error_naming_file"] += 1
            else:
                bad_cases.append(f"{name} {info[0]}: error not naming the file: {text[:300]}")
            if not same(snapshot(target, target_opt), before):
                bad_cases.append(f"{name} {info[0]}: a failed load changed the model or optimizer")
            continue
        if same(snapshot(target, target_opt), saved):
            counts["equal"] += 1
        else:
            bad_cases.append(f"{name} {info[0]}: loaded values differ from the saved ones")
        target, target_opt = trained(seed=2)  # back to its own values for the next case
    return {"counts": counts, "bad": bad_cases, "files": files}


class Tag:
    """An arbitrary class a module keeps as extra state."""

    def __init__(self, name: str):
        self.name = name


class _KeepsState(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def get_extra_state(self):
        return self.state

    def set_extra_state(self, state):
        self.state = state


def extra_state_allow_list(rank: int, world: int, path: str) -> None:
    """Extra state of tensors, numbers, strings and containers round-trips; an arbitrary
    class is refused at save, naming the key, unless it is on torch's weights-only
    allow-list (torch.serialization.safe_globals), which the load honours too."""
    def build(state):
        model, opt = trained()
        model.keeper = _KeepsState(state)
        return model, opt

    model, opt = build({"step": 7, "note": "warm", "scale": torch.tensor([2.5])})
    mfsdp.save_checkpoint(f"{path}/plain", model, opt)
    fresh, fresh_opt = build(None)
    mfsdp.load_checkpoint(f"{path}/plain", fresh, fresh_opt)
    got = fresh.keeper.state
    assert got["step"] == 7 and got["note"] == "warm" and torch.equal(got["scale"], torch.tensor([2.5])), got

    model, opt = build({"tag": Tag("x")})
    expect_error(lambda: mfsdp.save_checkpoint(f"{path}/tagged", model, opt), TypeError, "keeper._extra_state",
                 "cannot be loaded without running code", "add_safe_globals")
    assert not os.path.exists(f"{path}/tagged"), "a refused save wrote the checkpoint"
    with torch.serialization.safe_globals([Tag]):
        mfsdp.save_checkpoint(f"{path}/tagged", model, opt)
        fresh, fresh_opt = build(None)
        mfsdp.load_checkpoint(f"{path}/tagged", fresh, fresh_opt)
    assert isinstance(fresh.keeper.state["tag"], Tag) and fresh.keeper.state["tag"].name == "x"
    fresh, fresh_opt = build(None)  # off the allow-list again: refused at load, naming the entry
    expect_error(lambda: mfsdp.load_checkpoint(f"{path}/tagged", fresh, fresh_opt), mfsdp.CheckpointError,
                 "model.keeper._extra_state")
    assert fresh.keeper.state is None, "a refused load applied extra state"


def legacy_format(rank: int, world: int, path: str) -> None:
    """Checkpoints whose metadata and extra state an earlier version pickled: builtin-only
    pickles still load (the same values); a pickle naming a class is refused with how to
    convert, and runs nothing."""
    model, opt = trained()
    model.keeper = _KeepsState({"step": 3})
    sd = flat_state_dict(model, opt)
    # What the earlier version wrote: pickle.dumps of the same builtin values.
    sd["meta.param_shapes"] = pickle.dumps({k: tuple(v) for k, v in json.loads(sd["meta.param_shapes"]).items()})
    sd["optim.param_groups"] = pickle.dumps([{**{k: tuple(v["__tuple__"]) if isinstance(v, dict) else v
                                                 for k, v in g.items()}} for g in json.loads(sd["optim.param_groups"])])
    sd["optim.class"] = pickle.dumps(json.loads(sd["optim.class"]))
    sd["model.keeper._extra_state"] = pickle.dumps({"step": 3})
    dcp.save(sd, checkpoint_id=f"{path}/legacy")
    fresh, fresh_opt = trained(seed=5)
    fresh.keeper = _KeepsState(None)
    mfsdp.load_checkpoint(f"{path}/legacy", fresh, fresh_opt, verify=False)
    assert same(snapshot(fresh, fresh_opt), snapshot(model, opt)) and fresh.keeper.state == {"step": 3}
    assert fresh_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]

    marker = f"{path}/ran_legacy_extra_state"
    sd["model.keeper._extra_state"] = pickle.dumps({"step": Opens(marker)})
    dcp.save(sd, checkpoint_id=f"{path}/legacy_class")
    other, other_opt = trained(seed=6)
    other.keeper = _KeepsState(None)
    expect_error(lambda: mfsdp.load_checkpoint(f"{path}/legacy_class", other, other_opt, verify=False),
                 mfsdp.CheckpointError, "model.keeper._extra_state", "a pickle that names", "open",
                 "save it again with this one")
    dist.barrier()
    assert not os.path.exists(marker), "loading a legacy pickle ran its code"
