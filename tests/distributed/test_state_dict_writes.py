"""Writes into `model.state_dict()` values reach the model, as on a plain module and under
FSDP2, whose state-dict values are the parameters' storage. Ours are copies (our flat
shards are not FSDP2's rows), so the unit applies what was written into them at its next
use: a forward, an optimizer step, unshard(), a load or the next state_dict(). The same
for the optimizer's state dict.

What users write that way, each run on FSDP2 and on ours side by side from the same
weights and data and compared (losses, gradients between backward and the step, full
values):
- torch.distributed.checkpoint loading in place into `{"model": model.state_dict()}` or
  `{"optim": optimizer.state_dict()}` with no load_state_dict() after (DCP loads in place),
  also under tensor parallelism (tp 2 x dp 2) and with experts on their own mesh;
- an EMA model updated through its state dict, as timm's ModelEmaV2/V3 do
  (`ema_v.lerp_(model_v)`, or `torch._foreach_lerp_` over the values);
- a write on one rank only, then an optimizer step before any forward (HSDP 2 x 2 too);
- state dicts written and then dropped before the next use: timm's ModelEmaV2 loop over
  a temporary `zip(ema.state_dict().values(), model.state_dict().values())`, dcp.load
  inside a helper that returns, one rank writing while the others drop theirs;
- a resume into a fresh model and optimizer through `{"model": model.state_dict(),
  "optim": get_optimizer_state_dict(model, opt)}` (torch takes a zero-lr optimizer step
  in between to create the state), then set_optimizer_state_dict only; and our
  full_state_dict() after an in-place load.
And what cannot be made right is refused on every rank, naming the parameters."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness import gpu_launch, gpu_world, run_distributed
from harness.moe_unit_workers import HAS_FSDP2_PLACEMENTS
from harness.workers import ResidualTokenNet

VOCAB, DIM, ROWS = 11, 20, 8


def Net():
    """Rows that do not split evenly at worlds 2 and 4 (flat pieces cross row boundaries)."""
    return ResidualTokenNet(VOCAB, DIM, 13)


def _dev() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sharded(impl: str, mesh=None, seed: int = 0) -> Net:
    if impl == "ours":
        from megatron_fsdp_ext import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = Net().to(_dev())
    kwargs = {} if mesh is None else {"mesh": mesh}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (ROWS, 5), generator=g), torch.randint(0, VOCAB, (ROWS, 5), generator=g)


def _rows():
    per = ROWS // dist.get_world_size()
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def _loss(model, step: int) -> torch.Tensor:
    x, y = (t[_rows()].to(_dev()) for t in _batch(step))
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _global(value: torch.Tensor) -> float:
    t = value.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return float(t.cpu()) / dist.get_world_size()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().cpu()


def _full_grads(model) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def _full_values(model) -> dict:
    """Full values, read through state_dict() (which applies pending writes itself: read
    after a forward, whose loss is what tells whether the forward saw them)."""
    return {k: _full(v) for k, v in model.state_dict().items()}


def _close(a: dict, b: dict, what: str, tol: float) -> None:
    assert sorted(a) == sorted(b), (what, sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol / 10, msg=f"{what} '{k}'")


def _train_step(model, opt, step: int) -> float:
    loss = _loss(model, step)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return _global(loss)


def _dcp_in_place(impl: str, folder: str) -> dict:
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    saved = {k: _full(v) for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, impl))
    _train_step(model, opt, 1)
    _train_step(model, opt, 2)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, impl))  # in place; no load_state_dict() after
    # Read through the parameters before any use (verifying a load, starting an EMA): the loaded values.
    read = {n: p.full_tensor().detach().double().cpu() for n, p in model.named_parameters()}
    loss = _loss(model, 3)
    loss.backward()
    return {"loss": _global(loss), "grads": _full_grads(model), "saved": saved, "read": read}


def _optimizer_dcp_in_place(impl: str, folder: str) -> dict:
    """The optimizer's state loaded in place into `{"optim": optimizer.state_dict()}`, no
    optimizer.load_state_dict() after: the next step uses the loaded moments."""
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=os.path.join(folder, "optim_" + impl))
    _train_step(model, opt, 1)
    state = {"optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "optim_" + impl))
    loss = _train_step(model, opt, 2)  # its step reads the loaded moments
    return {"loss": loss, "values": _full_values(model)}


def _ema(impl: str, foreach: bool) -> dict:
    model, ema = _sharded(impl), _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        _train_step(model, opt, step)
        with torch.no_grad():  # timm's ModelEmaV3.apply_update_: the values of both state dicts
            pairs = [(e, m) for e, m in zip(ema.state_dict().values(), model.state_dict().values())
                     if e.is_floating_point()]
            if foreach:
                torch._foreach_lerp_([e for e, _ in pairs], [m for _, m in pairs], weight=0.25)
            else:
                for e, m in pairs:
                    e.lerp_(m, 0.25)
    loss = _global(_loss(ema, 7))
    return {"loss": loss, "values": _full_values(ema), "model": _full_values(model)}


def _ema_of_a_temporary_dict(impl: str) -> dict:
    """timm's ModelEmaV2._update: the state dicts are temporaries, dropped as the loop ends,
    before the EMA's next use."""
    model, ema = _sharded(impl), _sharded(impl, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        _train_step(model, opt, step)
        with torch.no_grad():
            for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
                ema_v.copy_(ema_v * 0.75 + 0.25 * model_v)
    loss = _global(_loss(ema, 7))
    return {"loss": loss, "values": _full_values(ema), "model": _full_values(model)}


def _restore(model, path: str) -> None:
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # in place, and the dict goes when this returns


def _dcp_in_a_helper(impl: str, folder: str) -> dict:
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    path = os.path.join(folder, "helper_" + impl)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    saved = {k: _full(v) for k, v in model.state_dict().items()}
    _train_step(model, opt, 1)
    _restore(model, path)
    loss = _loss(model, 3)
    loss.backward()
    return {"loss": _global(loss), "grads": _full_grads(model), "saved": saved}


def _resume_into_fresh(impl: str, folder: str) -> dict:
    """A fresh model (other weights) and a fresh optimizer: torch's get_optimizer_state_dict
    steps the optimizer at lr 0 to create its state before the load writes the model's
    values; only the optimizer's state is set after it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    path = os.path.join(folder, "fresh_" + impl)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    saved = {k: _full(v) for k, v in model.state_dict().items()}
    model = _sharded(impl, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    out = {"saved": saved}
    if impl == "ours":  # before any use: the full state dict must read the loaded values
        from megatron_fsdp_ext import full_state_dict
        out["full"] = {k: v.double() for k, v in full_state_dict(model, rank0_only=False).items()}
    del state
    loss = _train_step(model, opt, 1)
    out.update(loss=loss, values=_full_values(model))
    return out


def _one_rank_writes_the_others_drop(impl: str) -> dict:
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    state = model.state_dict()
    if dist.get_rank() == 0:
        with torch.no_grad():
            state["head.weight"].mul_(2.0)
    del state  # rank 0's write is in its rows only, as in FSDP2's aliased values
    loss = _loss(model, 1)
    loss.backward()
    return {"loss": _global(loss), "grads": _full_grads(model)}


class _SignStepIgnoringLr(torch.optim.Optimizer):
    """Keeps no state and moves each parameter by a fixed step against its gradient's sign,
    whatever its lr says (as Rprop's first step moves by its minimum step size at lr 0)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-0.25)


def _one_rank_holds_the_other_drops(impl: str) -> dict:
    """Rank 0 keeps a state dict, the others drop theirs unwritten; state_dict() is taken
    twice more (each settles the earlier values and keeps watching what some rank holds),
    then rank 0 writes and training goes on: the watch lists must stay the same on every
    rank, or the next agreement pairs different collectives."""
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    state = model.state_dict()
    if dist.get_rank() != 0:
        del state
    for _ in range(2):
        model.state_dict()
    if dist.get_rank() == 0:
        with torch.no_grad():
            state["head.bias"].add_(0.5)
    loss = _loss(model, 1)
    loss.backward()
    return {"loss": _global(loss), "grads": _full_grads(model)}


def _held_while_the_parameters_change(impl: str, restore: bool = False) -> dict:
    """A state dict held (torchtitan's CheckpointManager keeps model.state_dict() from its
    construction) while the parameters change in place on their own side, before the next
    forward: the change stays, as under FSDP2 (where the held values are the parameters'
    storage and see it). Ours once took the held values' difference from the parameters
    for writes into them and put the old values back at that forward. `restore`: the held
    values are then written with the values they were handed out with, which puts those
    back (the fingerprint cannot see that write; the value's version counter does)."""
    model = _sharded(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    state = model.state_dict()
    handed = {k: v.detach().clone() for k, v in state.items()}
    with torch.no_grad():
        for p in model.blocks[0].parameters():
            p.mul_(0.5)
        model.head.weight.data.add_(0.25)
    if restore:  # then the held values written with what they were handed out with
        with torch.no_grad():
            for k, v in state.items():
                v.copy_(handed[k])
    loss = _loss(model, 1)
    loss.backward()
    assert len(state) > 0
    return {"loss": _global(loss), "grads": _full_grads(model), "values": _full_values(model)}


def _write_then_a_zero_lr_step_that_moves(impl: str) -> dict:
    """A step at lr 0 with no optimizer state changes nothing only on zero gradients. The
    dict is still held across the step and the next forward, so a watch kept past the
    step would carry its stale rows back."""
    model = _sharded(impl)
    _loss(model, 0).backward()
    state = model.state_dict()
    with torch.no_grad():
        state["head.weight"].mul_(2.0)
    opt = _SignStepIgnoringLr(model.parameters())
    opt.step()
    opt.zero_grad()
    loss = _loss(model, 1)
    loss.backward()
    del state
    return {"loss": _global(loss), "grads": _full_grads(model), "values": _full_values(model)}


def _write_then_step(impl: str, mesh_shape) -> dict:
    mesh = None if mesh_shape is None else init_device_mesh(_dev().type, mesh_shape,
                                                            mesh_dim_names=("replicate", "shard"))
    model = _sharded(impl, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_step(model, opt, 0)
    _loss(model, 1).backward()
    state = model.state_dict()
    if dist.get_rank() == 0:  # one rank's rows only
        with torch.no_grad():
            state["head.weight"].fill_(0.5)
            state["blocks.0.0.bias"].mul_(-3.0)
    opt.step()  # before any forward: the step must start from the written values
    opt.zero_grad()
    loss = _loss(model, 2)
    loss.backward()
    return {"loss": _global(loss), "grads": _full_grads(model)}


def _writes_vs_fsdp2(rank: int, world: int, case: str, folder: str = "", mesh_shape=None) -> bool:
    out = {}
    for impl in ("fsdp2", "ours"):
        if case == "dcp":
            out[impl] = _dcp_in_place(impl, folder)
        elif case == "optim_dcp":
            out[impl] = _optimizer_dcp_in_place(impl, folder)
        elif case in ("ema", "ema_foreach"):
            out[impl] = _ema(impl, foreach=case == "ema_foreach")
        elif case == "ema_temporary":
            out[impl] = _ema_of_a_temporary_dict(impl)
        elif case == "dcp_helper":
            out[impl] = _dcp_in_a_helper(impl, folder)
        elif case == "resume_fresh":
            out[impl] = _resume_into_fresh(impl, folder)
        elif case == "one_rank_writes":
            out[impl] = _one_rank_writes_the_others_drop(impl)
        elif case == "one_rank_holds":
            out[impl] = _one_rank_holds_the_other_drops(impl)
        elif case == "zero_lr_step":
            out[impl] = _write_then_a_zero_lr_step_that_moves(impl)
        elif case in ("param_side_change", "param_side_restored"):
            out[impl] = _held_while_the_parameters_change(impl, restore=case == "param_side_restored")
        else:
            out[impl] = _write_then_step(impl, mesh_shape)
    ref, got = out["fsdp2"], out["ours"]
    # On GPUs each system's kernels may differ in the last bits (FSDP2 computes on its own
    # unsharded tensors): the tolerance then allows for that, far below what a missed write moves.
    tol = 1e-6 if _dev().type == "cpu" else 1e-4
    assert abs(got["loss"] - ref["loss"]) <= tol * abs(ref["loss"]), (case, got["loss"], ref["loss"])
    for key in ("grads", "values", "saved", "model", "read"):
        if key in ref:
            _close(got[key], ref[key], f"{case}: {key}", tol)
    if case.startswith("ema"):  # the EMA lags the model: its values are its own, not a copy of the model's
        assert any(not torch.equal(ref["values"][k], ref["model"][k]) for k in ref["values"] if k != "scale")
    if case == "resume_fresh":  # the loaded values, read before any use
        _close(got["full"], ref["saved"], "full_state_dict() after the load", tol)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_load_in_place_reaches_the_model_as_under_fsdp2(world, tmp_path):
    assert run_distributed(_writes_vs_fsdp2, world, "dcp", str(tmp_path), timeout=180) == [True] * world


def test_optimizer_dcp_load_in_place_reaches_the_optimizer_as_under_fsdp2(tmp_path):
    assert run_distributed(_writes_vs_fsdp2, 2, "optim_dcp", str(tmp_path), timeout=180) == [True, True]


@pytest.mark.parametrize("case", ["ema", "ema_foreach"])
def test_ema_through_state_dict_values_as_under_fsdp2(case):
    assert run_distributed(_writes_vs_fsdp2, 2, case, timeout=180) == [True, True]


@pytest.mark.parametrize("case", ["ema_temporary", "dcp_helper", "one_rank_writes", "one_rank_holds"])
def test_state_dicts_written_then_dropped_as_under_fsdp2(case, tmp_path):
    assert run_distributed(_writes_vs_fsdp2, 2, case, str(tmp_path), timeout=180) == [True, True]


@pytest.mark.parametrize("world", [2, 3])
def test_a_held_state_dict_keeps_changes_made_on_the_parameters_side_as_under_fsdp2(world):
    assert run_distributed(_writes_vs_fsdp2, world, "param_side_change", timeout=180) == [True] * world


def test_held_values_written_back_as_handed_out_restore_them_as_under_fsdp2():
    assert run_distributed(_writes_vs_fsdp2, 2, "param_side_restored", timeout=180) == [True, True]


def test_a_zero_lr_step_on_nonzero_gradients_is_a_use_as_under_fsdp2():
    assert run_distributed(_writes_vs_fsdp2, 2, "zero_lr_step", timeout=180) == [True, True]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_into_a_fresh_model_through_get_optimizer_state_dict_as_under_fsdp2(world, tmp_path):
    assert run_distributed(_writes_vs_fsdp2, world, "resume_fresh", str(tmp_path), timeout=180) == [True] * world


@pytest.mark.parametrize("world,mesh_shape", [(2, None), (4, (2, 2))], ids=["fsdp_w2", "hsdp_2x2"])
def test_a_write_on_one_rank_then_a_step_as_under_fsdp2(world, mesh_shape):
    assert run_distributed(_writes_vs_fsdp2, world, "step", mesh_shape=mesh_shape, timeout=180) == [True] * world


def _tp_dcp_in_place(rank: int, world: int, folder: str) -> bool:
    """Tensor parallel 2 x FSDP 2 (the TP DTensors' mesh spans both dims): the model and the
    optimizer loaded in place by DCP with no load after, then one more step; the loss and
    every value equal FSDP2's on the same script."""
    from harness import tp_workers as tw

    mesh = tw.make_mesh((2, 2))
    dp_index, dp_world = tw.dp_rank_of(mesh)
    out = {}
    for impl in ("fsdp2", "ours"):
        model = tw.parallelize(tw.build(_dev()), mesh["tp"], sp=False)
        model = tw.shard_ours(model, tw.dp_mesh_of(mesh), {}) if impl == "ours" else \
            tw.shard_fsdp2(model, tw.dp_mesh_of(mesh))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        tw._step(model, opt, dp_index, dp_world, seed=1)
        where = os.path.join(folder, "tp_" + impl)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=where)
        tw._step(model, opt, dp_index, dp_world, seed=2)
        tw._step(model, opt, dp_index, dp_world, seed=3)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=where)
        tw._step(model, opt, dp_index, dp_world, seed=4)  # from the loaded values and moments
        out[impl] = {k: _full(v) for k, v in model.state_dict().items()}
    _close(out["ours"], out["fsdp2"], "tp 2 x dp 2 after the in-place load and a step", 1e-5)
    return True


def test_dcp_load_in_place_with_tensor_parallel_as_under_fsdp2(tmp_path):
    assert run_distributed(_tp_dcp_in_place, 4, str(tmp_path), timeout=180) == [True] * 4


def _moe_dcp_in_place(rank: int, world: int, folder: str) -> bool:
    """Experts on their own mesh (efsdp 2 x ep 2, companion units) and dense units on the
    dp mesh: the model loaded in place by DCP with no load after; the next loss and every
    value equal FSDP2's with the same placement."""
    from harness import moe_unit_workers as mw

    out = {}
    for impl in ("fsdp2", "ours"):
        model, first, local = mw.build(impl, world, ep=2, replicate=1, factor=1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        gen = torch.Generator().manual_seed(100 + rank)

        def step():
            loss = model(torch.randn(mw.TOKENS, mw.DIM, generator=gen).to(_dev()), first, local).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return _global(loss)

        step()
        where = os.path.join(folder, "moe_" + impl)
        dcp.save({"model": model.state_dict()}, checkpoint_id=where)
        step()
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=where)
        out[impl] = {"loss": step(), "values": {k: _full(v) for k, v in model.state_dict().items()}}
    assert abs(out["ours"]["loss"] - out["fsdp2"]["loss"]) <= 1e-6 * abs(out["fsdp2"]["loss"]), \
        f"loss after the in-place load: ours {out['ours']['loss']!r} vs FSDP2 {out['fsdp2']['loss']!r}"
    _close(out["ours"]["values"], out["fsdp2"]["values"], "experts on efsdp x ep after the in-place load", 1e-5)
    return True


@pytest.mark.skipif(not HAS_FSDP2_PLACEMENTS, reason="this torch has no ShardPlacementResult (FSDP2's expert mesh)")
def test_dcp_load_in_place_with_expert_parallelism_as_under_fsdp2(tmp_path):
    assert run_distributed(_moe_dcp_in_place, 4, str(tmp_path), timeout=180) == [True] * 4


def _one_agreement_per_forward(rank: int, world: int) -> list:
    """state_dict() taken and dropped (a job logging norms every step): the next forward
    settles every unit's handed-out values with one all-reduce of flags, not one per unit.
    Counted at torch.distributed.all_reduce (the units' own collectives go through C++)."""
    model = _sharded("ours")
    counts = []
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for step in range(2):
        norms = {k: float(v.full_tensor().norm()) for k, v in model.state_dict().items() if isinstance(v, DTensor)}
        assert len(norms) >= 3
        calls.clear()
        dist.all_reduce = counting
        try:
            loss = _loss(model, step)
        finally:
            dist.all_reduce = real
        counts.append(len(calls))
        loss.backward()
        model.zero_grad()
    return counts


def test_the_next_forward_settles_every_unit_in_one_collective():
    for counts in run_distributed(_one_agreement_per_forward, 2, timeout=120):
        assert counts == [1, 1], f"all-reduces in the forward after state_dict(): {counts} (3 units)"


def _refused(rank: int, world: int, case: str) -> str:
    model = _sharded("ours")
    _loss(model, 0).backward()
    model.zero_grad()
    if case == "between":
        loss = _loss(model, 1)
        state = model.state_dict()
        with torch.no_grad():
            state["head.bias"].add_(1.0)
        try:
            loss.backward()
        except RuntimeError as e:
            return str(e)
        return "no error"
    state = model.state_dict()
    if case == "twice":
        other = model.state_dict()
        with torch.no_grad():
            state["head.weight"].mul_(2.0)
            other["head.weight"].add_(1.0)
    try:
        _loss(model, 1)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,words", [("twice", "in two state dicts were both written"),
                                        ("between", "between a forward and its backward")])
def test_writes_that_cannot_apply_are_refused_on_every_rank(case, words):
    for message in run_distributed(_refused, 2, case, timeout=120):
        assert words in message and "head." in message, message


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dcp", "optim_dcp", "ema_foreach", "step", "ema_temporary", "dcp_helper", "zero_lr_step",
                                  "resume_fresh", "one_rank_writes", "param_side_change",
                                  "param_side_restored"])
def test_state_dict_writes_on_nccl(case, tmp_path):
    """The same comparisons with NCCL and CUDA tensors: the flags' all-reduce and the rows'
    exchange on the GPU."""
    world = gpu_world()
    assert run_distributed(_writes_vs_fsdp2, world, case, str(tmp_path), timeout=300, **gpu_launch()) == [True] * world


@pytest.mark.gpu
def test_writes_that_cannot_apply_are_refused_on_nccl():
    world = gpu_world()
    for message in run_distributed(_refused, world, "twice", timeout=300, **gpu_launch()):
        assert "in two state dicts were both written" in message, message
