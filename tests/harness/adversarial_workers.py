"""What an adversarial user tries: freezing after sharding, per-rank differences in paths,
values and options, malformed inputs. Each worker checks the behaviour a user expects
against plain PyTorch or names the error it must raise."""
from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

from .workers import build_models, check_grads, device_for_backend, expect_error, global_batches, shard


def freeze_after_sharding(rank: int, world: int, opts: Dict) -> None:
    """requires_grad_(False) on sharded parameters after fully_shard stops their
    gradients and updates from the next forward on, and requires_grad_(True) brings them
    back, exactly as on the plain model: gradients (None-ness and values) and parameters
    compared with the single-process reference every step."""
    device = device_for_backend()
    cfg, model, ref = build_models({"layers": 2}, device)
    shard(model, opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    names = ["blocks.0.attn.wqkv.weight", "norm.weight"]
    ours = dict(model.named_parameters())
    theirs = dict(ref.named_parameters())
    per = 2
    for step, (tokens, targets) in enumerate(global_batches(cfg, 5, per * world, 8, device)):
        if step in (1, 3):
            for n in names:  # frozen at step 1, unfrozen at step 3, on both
                ours[n].requires_grad_(step == 3)
                theirs[n].requires_grad_(step == 3)
        rows = slice(rank * per, (rank + 1) * per)
        model.loss(tokens[rows], targets[rows]).backward()
        ref.loss(tokens, targets).backward()
        check_grads(step, model, ref, replicated=False, tol=1e-5)
        frozen = step in (1, 2)
        for n in names:
            assert (ours[n].grad is None) == frozen, f"step {step}: '{n}' grad is {ours[n].grad is None and 'None'}"
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), f"'{k}' differs from the plain model"


def safetensors_misuse(rank: int, world: int, directory: str) -> None:
    """Ranks given different paths are refused on every rank before anything is read; a
    truncated file in the directory is an error naming that file; nothing is loaded."""
    from safetensors.torch import save_file

    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 1}, device)
    shard(model, {})
    sd = {k: v.detach().cpu().contiguous() for k, v in LlamaModel(cfg).state_dict().items()}
    keys = sorted(sd)
    if rank == 0:
        for sub in ("a", "b"):
            os.makedirs(f"{directory}/{sub}")
            save_file({k: sd[k] for k in keys[:2]}, f"{directory}/{sub}/one.safetensors")
            save_file({k: sd[k] for k in keys[2:]}, f"{directory}/{sub}/two.safetensors")
        with open(f"{directory}/b/two.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(f"{directory}/b/two.safetensors") // 2)
    dist.barrier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expect_error(lambda: mfsdp.load_safetensors(model, f"{directory}/{'a' if rank == 0 else 'b'}"), ValueError,
                 "load_safetensors", "different checkpoint paths")
    expect_error(lambda: mfsdp.load_safetensors(model, f"{directory}/b"), ValueError, "two.safetensors")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"a refused load changed '{n}'"


def full_state_dict_bad_values(rank: int, world: int, broadcast: bool) -> None:
    """A meta tensor or a non-tensor value in the dict given to load_full_state_dict
    (streamed from rank 0 or passed on every rank) is refused on every rank, naming the
    key, before any value is written; no rank hangs."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 2}, device)
    shard(model, {})
    good = LlamaModel(cfg).state_dict()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for bad_key, bad_value, fragment in (("blocks.1.mlp.w_down.weight", torch.empty(good["blocks.1.mlp.w_down.weight"]
                                                                                    .shape, device="meta"),
                                          "is a meta tensor"),
                                         ("norm.weight", [1.0] * cfg.d_model, "is a list, not a tensor")):
        sd = dict(good)
        if rank == 0:
            sd[bad_key] = bad_value
        given = sd if (rank == 0 or not broadcast) else None
        expect_error(lambda: mfsdp.load_full_state_dict(model, given, broadcast_from_rank0=broadcast),
                     (TypeError, ValueError, RuntimeError), bad_key)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), f"'{n}' was overwritten by a refused load"


def full_state_dict_with_reshaping_hooks(rank: int, world: int) -> None:
    """A model whose own state-dict hook reshapes a parameter (torchtitan's fused-qkv
    split) cannot take load_full_state_dict, which runs the hooks on this rank's pieces:
    refused on every rank naming the way that works, nothing written; that way
    (set_model_state_dict with full values, the hooks run on whole tensors) loads it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = device_for_backend()

    def split_on_save(module, state_dict, prefix, local_metadata):
        w = state_dict.pop(f"{prefix}weight")
        if hasattr(w, "full_tensor"):  # a DTensor, made whole as torchtitan's hook does
            w = w.full_tensor()
        rows = w.shape[0] // 2
        state_dict[f"{prefix}top"], state_dict[f"{prefix}bottom"] = w.reshape(2, rows, w.shape[1]).unbind(0)

    def merge_on_load(module, state_dict, prefix, *args):
        if f"{prefix}top" in state_dict:
            state_dict[f"{prefix}weight"] = torch.cat([state_dict.pop(f"{prefix}top"),
                                                       state_dict.pop(f"{prefix}bottom")])

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 2)).to(device)
        model[0]._register_state_dict_hook(split_on_save)
        model[0]._register_load_state_dict_pre_hook(merge_on_load, with_module=True)
        return model

    plain = build()
    values = {k: v + 1 for k, v in plain.state_dict().items()}
    model = build()
    mfsdp.fully_shard(model[0])
    mfsdp.fully_shard(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expect_error(lambda: mfsdp.load_full_state_dict(model, values), RuntimeError,
                 "state-dict hooks", "set_model_state_dict")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"'{n}' was overwritten by a refused load"
    set_model_state_dict(model, dict(values), options=StateDictOptions(full_state_dict=True))  # the hook pops keys
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    assert full.keys() == values.keys(), sorted(full)
    for k, v in values.items():
        assert torch.equal(full[k], v), f"'{k}' loaded through set_model_state_dict differs"


def bucket_options_differ(rank: int, world: int, kind: str) -> None:
    """Ranks whose root buckets differently (gather_bucket_bytes or reduce_bucket_bytes)
    are refused at the first forward, naming the option, instead of pairing a coalesced
    collective with per-unit ones (Gloo aborts the process on the size mismatch)."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 3}, device)
    shard(model, {kind: (1 << 30) if rank == 0 else 0})
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    expect_error(lambda: model.loss(tokens, tokens), ValueError, "ranks built different models", kind)


def bucket_setters_differ_under_check(rank: int, world: int) -> None:
    """Set on some ranks only after the first step, under MFSDP_CHECK_COLLECTIVES=1: the
    collective check names ranks that bucket differently instead of the backend aborting."""
    os.environ["MFSDP_CHECK_COLLECTIVES"] = "1"
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 3}, device)
    shard(model, {"timeout": 60})  # a stalled rank fails within a minute
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    model.loss(tokens, tokens).backward()
    if rank == 0:
        model.set_gather_bucket_bytes(1 << 30)
    expect_error(lambda: model.loss(tokens, tokens).backward(), RuntimeError, "collectives out of step",
                 "units", "bucket")


def unclear_inputs(rank: int, world: int) -> None:
    """The inputs that gave unclear errors or none: each now behaves or names the problem."""
    device = device_for_backend()

    class ZeroSize(nn.Module):  # every parameter of the unit has zero elements
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.zeros(0, device=device))
            self.b = nn.Parameter(torch.zeros(0, 3, device=device))
            self.lin = nn.Linear(3, 3, bias=False, device=device)

        def forward(self, x):
            return self.lin(x) + self.a.sum() + self.b.sum()

    z = ZeroSize()
    mfsdp.fully_shard(z.lin)
    mfsdp.fully_shard(z)  # the root unit holds only the zero-size parameters
    x = torch.randn(2, 3, device=device)
    z(x).sum().backward()
    z(x).sum().backward()
    assert z.a.grad is not None and z.a.grad.numel() == 0

    cfg, model, _ = build_models({"layers": 1}, device)
    shard(model, {})
    for bad in ("False", None, 0):
        expect_error(lambda: model.set_requires_gradient_sync(bad), TypeError,
                     f"set_requires_gradient_sync expects a bool, got {bad!r}")

    with torch.device("meta"):
        meta = LlamaModel(cfg)
    block = type(meta.blocks[0])
    assert mfsdp.estimate_memory(meta, world, unit_modules=block) == mfsdp.estimate_memory(meta, world,
                                                                                          unit_modules=[block])
    expect_error(lambda: mfsdp.estimate_memory(meta, world, prefetch_depth=True), ValueError,
                 "prefetch_depth must be an int >= 0, got True")

    # A root-only setter on a block: refused at once after the first forward ...
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), device=device)
    model.loss(tokens, tokens).backward()
    expect_error(lambda: model.blocks[0].set_gather_bucket_bytes(1 << 20), ValueError,
                 "set_gather_bucket_bytes", "is not the root", "call set_gather_bucket_bytes on the root")
    # ... and at the first forward when called before it.
    cfg, fresh, _ = build_models({"layers": 1}, device)
    shard(fresh, {})
    fresh.blocks[0].set_reduce_bucket_bytes(1 << 20)
    expect_error(lambda: fresh.loss(tokens, tokens), ValueError, "set_reduce_bucket_bytes was called on blocks.0",
                 "not the root")


def mesh_dims_in_the_wrong_order(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = device_for_backend()
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_shard", "dp_outer"))
    cfg, model, _ = build_models({"layers": 1}, device)
    expect_error(lambda: mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(), fsdp_unit_modules=[type(model.blocks[0])],
                                                 device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer"),
                 ValueError, "dp_shard_dim='dp_shard' before dp_outer_dim='dp_outer'", "replicate (outer) dimension first")
    expect_error(lambda: mfsdp.fully_shard_model(model, mfsdp.FSDPConfig(), device_mesh=mesh, dp_shard_dim="dp_shard",
                                                 dp_outer_dim="dp_shard"), ValueError, "must differ")


def nan_check(rank: int, world: int, opts: Dict) -> None:
    """check_for_nan_in_grad: a NaN (then an Inf) planted in rank 1's gradient stops
    optimizer.step() and clip_grad_norm_ on every rank with an error naming the ranks,
    units and parameters; the parameters are left as they were; finite steps before and
    after train as usual (the flag is reset)."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 2}, device)
    shard(model, dict(opts, check_for_nan_in_grad=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = list(global_batches(cfg, 6, 2 * world, 8, device))
    rows = slice(rank * 2, rank * 2 + 2)
    planted = [None]

    def plant(module, args, output):
        if rank == 1 and planted[0] is not None:
            output.register_hook(lambda g: g + planted[0])

    model.blocks[0].register_forward_hook(plant)

    def step(i, value=None, clip=False):
        planted[0] = value
        tokens, targets = batches[i]
        model.loss(tokens[rows], targets[rows]).backward()
        if clip:
            mfsdp.clip_grad_norm_(model, 1.0)
        opt.step()

    step(0)
    opt.zero_grad()
    # An Inf planted upstream turns into NaN where it meets -Inf in backward: either is named.
    for i, (value, kind, clip) in enumerate(((float("nan"), "(NaN)", False), (float("inf"), ")", False),
                                             (float("nan"), "(NaN)", True)), start=1):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        expect_error(lambda: step(i, value, clip), mfsdp.NonFiniteGradientError,
                     "clip_grad_norm_ refused" if clip else "AdamW.step() refused", "non-finite gradients",
                     "rank(s) [", "unit 'blocks.0'", kind)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), f"'{n}' changed although the step was refused"
        opt.zero_grad()
    step(4)  # finite again: the step is taken
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()), "no parameter moved"


def one_rank_state_dicts(rank: int, world: int, opts: Dict):
    """Rank 0 alone calls the model's and the optimizer's state_dict() and load_state_dict()
    (the DDP habit `if rank == 0: torch.save(model.state_dict(), f)`): each fails on rank 0
    within the units' timeout (opts["timeout"] s), naming the other ranks, with no
    collective issued (the process group still works after). Then every rank makes the
    same calls, rank 1 late: rank 0 warns and all complete with plain PyTorch's values; a
    plain root over sharded blocks checks its group once per call."""
    from megatron_fsdp_ext.core import arrival

    timeout = opts["timeout"]
    os.environ["MFSDP_ARRIVAL_WARN_S"] = "1"
    device = device_for_backend()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    net = copy.deepcopy(plain)
    for i in (0, 2):  # a plain root: the blocks' state_dict() calls are the outermost of ours
        mfsdp.fully_shard(net[i], timeout=timeout)
    x = torch.randn(4, 8, device=device)  # the same on every rank: the mean gradient is plain PyTorch's
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for model, optimizer in ((net, opt), (plain, torch.optim.AdamW(plain.parameters(), lr=0.1))):
        model(x).sum().backward()
        optimizer.step()
    saved, saved_opt = net.state_dict(), opt.state_dict()  # every rank: the values to load below
    calls = {"model state_dict()": net.state_dict, "optimizer.state_dict()": opt.state_dict,
             "load_state_dict()": lambda: net.load_state_dict(saved),
             "optimizer.load_state_dict()": lambda: opt.load_state_dict(saved_opt)}
    failures = {}
    if rank == 0:
        for what, call in calls.items():
            start = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    call()
                except RuntimeError as e:
                    failures[what] = (time.monotonic() - start, str(e), [str(w.message) for w in caught])
                else:
                    raise AssertionError(f"{what} on rank 0 alone returned")
    else:
        time.sleep(len(calls) * timeout + 2)  # past every failure on rank 0: none of its calls meets ours
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag)  # no collective of a failed call is pending on any rank
    assert flag.item() == world, flag

    checked = []
    original = arrival.await_group
    arrival.await_group = lambda group, what, limit: (checked.append(what), original(group, what, limit))[1]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 1:
                time.sleep(2.5)  # late, within the timeout: a warning on rank 0, no error
            sd = net.state_dict()
        late = [str(w.message) for w in caught if "to call it too" in str(w.message)]
        osd = opt.state_dict()
        net.load_state_dict(sd)
        opt.load_state_dict(osd)
    finally:
        arrival.await_group = original
    assert checked == ["state_dict()", "optimizer.state_dict()", "load_state_dict()",
                       "optimizer.load_state_dict()"], checked
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    expected = plain.state_dict()
    assert set(full) == set(expected), (set(full), set(expected))
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-6, msg=k)
    return failures, late, {k: v.tolist() for k, v in full.items()}


def check_one_rank_state_dicts(results, timeout: float) -> None:
    """What one_rank_state_dicts returned on every rank."""
    (failures, late, values), others = results[0], results[1:]
    world = len(results)
    absent = list(range(1, world))
    assert set(failures) == {"model state_dict()", "optimizer.state_dict()", "load_state_dict()",
                             "optimizer.load_state_dict()"}, failures
    for what, (elapsed, message, warned) in failures.items():
        assert (f"is a collective over the ranks {list(range(world))}, and rank(s) {absent} did not call it"
                in message), (what, message)
        assert "no collective was issued" in message and "torch.save(sd, path)" in message, message
        assert timeout - 0.5 <= elapsed < 2 * timeout, f"{what}: failed after {elapsed:.1f}s"
        assert any("has waited 1 s" in w and f"for rank(s) {absent} to call it too" in w for w in warned), \
            (what, warned)
    assert late and "state_dict() for rank(s) [1]" in late[0], late
    for r, (their_failures, their_late, their_values) in enumerate(others, start=1):
        assert their_failures == {} and their_late == [], (r, their_failures, their_late)
        assert their_values == values, r  # the same full values on every rank, after the failed calls
