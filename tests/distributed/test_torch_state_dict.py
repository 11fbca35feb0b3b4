"""torch's own state-dict tools on a sharded model: model.state_dict() / load_state_dict(),
torch.distributed.checkpoint (dcp.save / dcp.load) and its state-dict helpers
(get/set_model_state_dict, get/set_optimizer_state_dict with full_state_dict, cpu_offload,
broadcast_from_rank0), at the same and at another world size, and checkpoints exchanged
with FSDP2. Every value is compared with a plain single-process model trained on the same
data (the reference), and resumed training must continue exactly as the reference does:
AdamW moments that load into the wrong elements change the next step."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import megatron_fsdp_ext as mfsdp
from harness import gpu_world, run_distributed
from harness.workers import ResidualTokenNet, shard_blocks_and_root

STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "no_shard"]
VOCAB, DIM, ROWS = 13, 24, 4


def _tol():
    # The reference runs on the same device; on GPUs the half batches of the sharded run
    # meet other matmul kernels than the whole batch of the reference.
    return dict(rtol=1e-4, atol=1e-5) if _dev().type == "cuda" else dict(rtol=1e-5, atol=1e-6)


def Net():
    """Shapes whose flat pieces cross row boundaries at worlds 2 and 4, a norm, a buffer."""
    return ResidualTokenNet(VOCAB, DIM, DIM, inner_bias=False)


def _dev():
    """Where the models live: this rank's GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().to(_dev())


def _shard(model, strategy):
    return shard_blocks_and_root(model, sharding_strategy=strategy)


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    return shard_blocks_and_root(model, fully_shard)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (ROWS, 6), generator=g), torch.randint(0, VOCAB, (ROWS, 6), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(model, opt, steps, first=0, rows=None):
    """`rows`: this rank's slice of each batch (the sharded runs); None: the whole batch."""
    for step in range(first, first + steps):
        x, y = (t.to(next(model.parameters()).device) for t in _batch(step))
        if rows is not None:
            x, y = x[rows], y[rows]
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _my_rows():
    per = ROWS // dist.get_world_size()
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _reference(steps):
    ref = _net()
    opt = _opt(ref)
    _train(ref, opt, steps)
    return ref, opt


def _ref_optim_by_name(ref, opt):
    return {name: opt.state[p] for name, p in ref.named_parameters()}


def _assert_model_equal(full_sd, ref):
    expected = ref.state_dict()
    assert set(full_sd) == set(expected), (sorted(full_sd), sorted(expected))
    for k, v in expected.items():
        got = full_sd[k]
        assert not isinstance(got, DTensor) and tuple(got.shape) == tuple(v.shape), (k, type(got), got.shape)
        torch.testing.assert_close(got.cpu(), v.cpu(), **_tol(), msg=k)


def _assert_optim_equal(full_osd, ref, ref_opt):
    expected = _ref_optim_by_name(ref, ref_opt)
    assert set(full_osd["state"]) == set(expected)
    for name, entry in expected.items():
        for key, v in entry.items():
            torch.testing.assert_close(full_osd["state"][name][key].cpu(), v.cpu(), **_tol(), msg=f"{name}.{key}")


def _full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _load_with_torch(model, opt, ckpt_dir):
    """torchtitan's {"model", "optimizer"} DCP checkpoint through torch's helpers."""
    target = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_model_state_dict(model, target["model"])
    set_optimizer_state_dict(model, opt, target["optimizer"])


def _load_check_and_resume(model, opt, ckpt_dir, ref, ref_opt, load=_load_with_torch):
    """Load a DCP checkpoint into `model`/`opt` (through torch's helpers, or `load`);
    both must equal the reference, and one more step must too."""
    load(model, opt, ckpt_dir)
    _assert_model_equal(_full(model), ref)
    _assert_optim_equal(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
                        ref, ref_opt)
    _train(ref, ref_opt, 1, first=2)
    _train(model, opt, 1, first=2, rows=_my_rows())
    _assert_model_equal(_full(model), ref)


def _state_dicts_and_dcp(rank, world, strategy, ckpt_dir):
    ref, ref_opt = _reference(2)
    model = _shard(_net(), strategy)
    opt = _opt(model)
    _train(model, opt, 2, rows=_my_rows())

    # model.state_dict(): full shapes; DTensors sharded on dim 0 (plain for no_shard).
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        got = sd[k]
        assert tuple(got.shape) == tuple(v.shape), k
        if k != "scale" and strategy != "no_shard":
            assert isinstance(got, DTensor), (k, type(got))
        torch.testing.assert_close((got.full_tensor() if isinstance(got, DTensor) else got).cpu(), v.cpu(), **_tol())

    # torch's helpers: full state dicts, on every rank or offloaded to rank 0's CPU.
    _assert_model_equal(_full(model), ref)
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _assert_model_equal(offloaded, ref)
        assert all(v.device.type == "cpu" for v in offloaded.values())
    else:
        assert offloaded == {}
    full_osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    _assert_optim_equal(full_osd, ref, ref_opt)

    # DCP round trip (torchtitan's layout) into a fresh model and optimizer, then resume.
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt_dir)
    fresh = _shard(_net(seed=7), strategy)
    _load_check_and_resume(fresh, _opt(fresh), ckpt_dir, ref, ref_opt)

    # Full state dicts in: every rank holds it, or only rank 0 (broadcast_from_rank0).
    ref_sd = ref.state_dict()
    ref_full_osd = get_optimizer_state_dict(ref, ref_opt, options=StateDictOptions(full_state_dict=True))
    for broadcast in (False, True):
        other = _shard(_net(seed=11), strategy)
        other_opt = _opt(other)
        _train(other, other_opt, 1, rows=_my_rows())  # state exists and is wrong
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        given = ref_sd if (rank == 0 or not broadcast) else {}
        set_model_state_dict(other, copy.deepcopy(given), options=opts)
        set_optimizer_state_dict(other, other_opt, copy.deepcopy(ref_full_osd if given else {}), options=opts)
        _assert_model_equal(_full(other), ref)
        _assert_optim_equal(get_optimizer_state_dict(other, other_opt, options=StateDictOptions(full_state_dict=True)),
                            ref, ref_opt)
        # plain load_state_dict of a full (unsharded) state dict
        other.load_state_dict(_net(seed=3).state_dict())
        _assert_model_equal(_full(other), _net(seed=3))
    return True


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_helpers_and_dcp_match_plain_pytorch(strategy, tmp_path):
    assert run_distributed(_state_dicts_and_dcp, 2, strategy, str(tmp_path / "ckpt"), timeout=240) == [True, True]
    # The checkpoint holds full shapes: a plain single-process model loads it.
    ref, _ = _reference(2)
    plain = _net(seed=5)
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    plain.load_state_dict(sd["model"])
    _assert_model_equal(plain.state_dict(), ref)


def _plain_dcp_even_split(rank, world, ckpt_dir):
    """dcp.save(model.state_dict()) of a Linear(64, 64) split evenly: each rank's rows
    must come back (this loaded rank 0's half everywhere when shards were plain tensors)."""
    torch.manual_seed(0)
    ref = nn.Linear(64, 64)
    model = mfsdp.fully_shard(copy.deepcopy(ref))
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    torch.manual_seed(1)
    fresh = mfsdp.fully_shard(nn.Linear(64, 64))
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(sd)
    _assert_model_equal(_full(fresh), ref)
    x = torch.randn(3, 64)
    torch.testing.assert_close(fresh(x), ref(x), **_tol())
    return True


def test_plain_dcp_save_load_even_split(tmp_path):
    assert run_distributed(_plain_dcp_even_split, 2, str(tmp_path / "ckpt"), timeout=120) == [True, True]


def _save_then_check(rank, world, strategy, ckpt_dir, ours=False):
    """Train two steps and save: through torch's helpers, or with ours (save_checkpoint)."""
    model = _shard(_net(), strategy)
    opt = _opt(model)
    _train(model, opt, 2, rows=_my_rows())
    if ours:
        mfsdp.save_checkpoint(ckpt_dir, model, opt)
    else:
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=ckpt_dir)
    return True


def _load_with_ours(model, opt, ckpt_dir):
    mfsdp.load_checkpoint(ckpt_dir, model, opt, verify=False)


def _load_and_resume(rank, world, strategy, ckpt_dir, fsdp2, ours=False):
    """Load the checkpoint into FSDP2 or our model, through torch's helpers or (ours)
    load_checkpoint; a checkpoint torch's helpers wrote has no manifest, so ours refuses
    it unless verify=False."""
    ref, ref_opt = _reference(2)
    model = _fsdp2(_net(seed=9)) if fsdp2 else _shard(_net(seed=9), strategy)
    opt = _opt(model)
    if ours and not os.path.exists(os.path.join(ckpt_dir, "mfsdp_manifest.json")):
        with pytest.raises(mfsdp.CheckpointError, match="has no mfsdp_manifest.json.*verify=False"):
            mfsdp.load_checkpoint(ckpt_dir, model, opt)
    _load_check_and_resume(model, opt, ckpt_dir, ref, ref_opt, _load_with_ours if ours else _load_with_torch)
    return True


def _fsdp2_save(rank, world, ckpt_dir):
    model = _fsdp2(_net())
    opt = _opt(model)
    _train(model, opt, 2, rows=_my_rows())
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt_dir)
    return True


def test_checkpoint_resharded_across_world_sizes_and_strategies(tmp_path):
    ckpt = str(tmp_path / "w4")
    assert run_distributed(_save_then_check, 4, "optim_grads_params", ckpt, timeout=180) == [True] * 4
    assert run_distributed(_load_and_resume, 2, "optim", ckpt, False, timeout=180) == [True] * 2
    # save_checkpoint writes the same state dicts: torch's helpers and ours read it at another world.
    saved = str(tmp_path / "w4_ours")
    assert run_distributed(_save_then_check, 4, "optim_grads_params", saved, True, timeout=180) == [True] * 4
    assert run_distributed(_load_and_resume, 2, "optim", saved, False, timeout=180) == [True] * 2
    assert run_distributed(_load_and_resume, 2, "no_shard", saved, False, True, timeout=180) == [True] * 2


def test_checkpoints_interchange_with_fsdp2(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "fsdp2")
    assert run_distributed(_save_then_check, 2, "optim_grads_params", ours, True, timeout=180) == [True] * 2
    assert run_distributed(_load_and_resume, 2, None, ours, True, timeout=180) == [True] * 2  # FSDP2 loads ours
    assert run_distributed(_fsdp2_save, 2, theirs, timeout=180) == [True] * 2
    assert run_distributed(_load_and_resume, 4, "optim_grads_params", theirs, False, True,
                           timeout=180) == [True] * 4  # ours loads FSDP2's with load_checkpoint


def _plain_load_and_refusals(rank, world):
    # An optimizer that never stepped has none of our hooks yet: its load_state_dict takes
    # the DTensors as they are, and the first step cuts this rank's pieces before using them.
    ref, ref_opt = _reference(2)
    model = _shard(_net(), "optim_grads")
    opt = _opt(model)
    _train(model, opt, 2, rows=_my_rows())
    fresh = _shard(_net(seed=4), "optim_grads")
    fresh_opt = _opt(fresh)
    fresh.load_state_dict(model.state_dict())
    fresh_opt.load_state_dict(opt.state_dict())
    _train(ref, ref_opt, 1, first=2)
    _train(fresh, fresh_opt, 1, first=2, rows=_my_rows())
    _assert_model_equal(_full(fresh), ref)

    model = _shard(_net(), "optim_grads_params")
    local = {k: v for k, v in model.named_parameters()}  # this rank's 1-D shards
    with pytest.raises(ValueError, match=r"expected the full shape \(13, 24\).*shard size"):
        model.load_state_dict({**model.state_dict(), "emb.weight": local["emb.weight"].detach().clone()})
    # assign=True writes the values into the unit's parameters (the objects stay): the
    # model holds the loaded values, and a value of another dtype is refused.
    params_before = list(model.parameters())
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(zeros, assign=True)
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    assert all(not p.detach().any() for p in model.parameters())
    with pytest.raises(RuntimeError, match="assign=True.*torch.float64 and the parameter torch.float32"):
        model.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, assign=True)
    model.load_state_dict(_net().state_dict())
    # local_state_dict(): this rank's shards as they are, loadable back in that mode only
    with mfsdp.local_state_dict():
        raw = model.state_dict()
        assert raw["emb.weight"].dim() == 1 and raw["emb.weight"].numel() == local["emb.weight"].detach().numel()
        model.load_state_dict(raw)

    # Inside local_state_dict(), full values and DTensors (model and optimizer) are cut to
    # this rank's piece on every rank: at world 2 some ranks hold a whole 1-D parameter
    # (norm.weight, head.bias), where a full value has the piece's shape, and the others
    # do not; the parameters and the moments must come out right on both.
    trained = _shard(_net(), "optim_grads_params")
    trained_opt = _opt(trained)
    _train(trained, trained_opt, 2, rows=_my_rows())
    for source in (trained.state_dict(), _full(trained)):
        # A copy each time: torch's load keeps a loaded Adam `step` tensor as it is, so
        # the step after the load would advance the trained optimizer's own.
        opt_dtensors = copy.deepcopy(trained_opt.state_dict())
        fresh = _shard(_net(seed=4), "optim_grads_params")
        fresh_opt = _opt(fresh)
        _train(fresh, fresh_opt, 1, rows=_my_rows())  # stepped: its optimizer hooks are attached
        with mfsdp.local_state_dict():
            fresh.load_state_dict(source)
            fresh_opt.load_state_dict(opt_dtensors)
        ref, ref_opt = _reference(2)
        _assert_model_equal(_full(fresh), ref)
        _train(ref, ref_opt, 1, first=2)
        _train(fresh, fresh_opt, 1, first=2, rows=_my_rows())
        _assert_model_equal(_full(fresh), ref)
    return True


def test_plain_load_state_dict_and_refusals(tmp_path):
    assert run_distributed(_plain_load_and_refusals, 2, timeout=120) == [True, True]


def _rename_legacy(module, state_dict, prefix, *args):
    for old in ("w_older", "w_old"):
        if prefix + old in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + old)


def _flip_and_double_bias(module, state_dict, prefix, *args):
    # Not elementwise: on this rank's piece it would give other values (or another shape).
    state_dict[prefix + "bias"] = state_dict[prefix + "bias"].flip(0) * 2


def _triple_bias(module, state_dict, prefix, *args):
    state_dict[prefix + "bias"] = state_dict[prefix + "bias"] * 3


def _user_load_pre_hooks_see_full_values(rank, world):
    """Load pre-hooks the user registers on a parameter's owner after fully_shard (renaming a
    legacy key, changing a value) see the full values, as on a plain model: ours, which cuts
    them, stays last, also behind a hook registered between two loads."""
    def full(model):
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}

    def check(model, ref, legacy):
        ref.load_state_dict(legacy)
        model.load_state_dict(legacy)
        got, want = full(model), ref.state_dict()
        assert set(got) == set(want), (sorted(got), sorted(want))
        for k, v in want.items():
            assert torch.equal(got[k], v), k

    source = _net(seed=7).state_dict()
    legacy = {k.replace("blocks.0.0.weight", "blocks.0.0.w_older").replace("head.weight", "head.w_old"): v
              for k, v in source.items()}
    ref, model = _net(), _net()
    for m in (ref, model):  # the one registered before fully_shard
        m.blocks[0][0].register_load_state_dict_pre_hook(_rename_legacy)
    _shard(model, "optim_grads_params")
    for m in (ref, model):
        for owner in (m.blocks[0][0], m.head):  # in a block's unit, in the root's
            owner.register_load_state_dict_pre_hook(_rename_legacy)
            owner.register_load_state_dict_pre_hook(_flip_and_double_bias)
    check(model, ref, legacy)
    for m in (ref, model):
        m.head.register_load_state_dict_pre_hook(_triple_bias)
    check(model, ref, legacy)

    # The parameters directly on the fully_shard module, the hooks on it too.
    torch.manual_seed(3)
    ref = nn.Linear(DIM, VOCAB).to(_dev())
    model = mfsdp.fully_shard(copy.deepcopy(ref))
    for m in (ref, model):
        m.register_load_state_dict_pre_hook(_rename_legacy)
        m.register_load_state_dict_pre_hook(_flip_and_double_bias)
    torch.manual_seed(4)
    legacy = {k.replace("weight", "w_old"): v for k, v in nn.Linear(DIM, VOCAB).state_dict().items()}
    check(model, ref, legacy)
    return True


def test_user_load_pre_hooks_after_fully_shard_see_full_values():
    assert run_distributed(_user_load_pre_hooks_see_full_values, 2, timeout=120) == [True, True]


def _state_dict_between_forward_and_backward(rank, world):
    """FSDP2's state-dict hooks reshard first, so state_dict() / load_state_dict() work
    after a forward that no backward followed yet (the root keeps its parameters
    unsharded then), and the backward still gets the gradients plain PyTorch gets. Inside
    backward they raise, naming the unit."""
    ref, model = _net(), _shard(_net(), "optim_grads_params")
    raised = []

    def during_backward(module, grad_input, grad_output):
        try:
            model.state_dict()
        except RuntimeError as e:
            raised.append(str(e))

    model.blocks[0].register_full_backward_hook(during_backward)
    x, y = (t.to(_dev()) for t in _batch(0))
    _loss(ref, x, y).backward()
    loss = _loss(model, x[_my_rows()], y[_my_rows()])  # the mean over this rank's rows: FSDP averages
    _assert_model_equal({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()},
                        _net())
    loss.backward()
    assert raised and "has its unsharded parameters installed" in raised[0], raised
    expected = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], **_tol(), msg=name)
    # After an explicit unshard() a load resharded first too; the next forward gathers the loaded values.
    model.unshard()
    model.load_state_dict(ref.state_dict())
    _assert_model_equal(_full(model), ref)
    torch.testing.assert_close(model(x[_my_rows()]), ref(x[_my_rows()]), **_tol())
    return True


def test_state_dict_between_forward_and_backward_as_fsdp2():
    assert run_distributed(_state_dict_between_forward_and_backward, 2, timeout=120) == [True, True]


def _rows_exchanged_not_gathered(rank, world):
    """state_dict() moves each unit's rows by one all-to-all (every element once), not by
    gathering the unit; the result, and what loads back, equal the gathering path's (a
    backend declared without all-to-all), DTensor for DTensor, at a world (3) that chunks
    rows unevenly."""
    from megatron_fsdp_ext import _C
    from megatron_fsdp_ext.backends import register_backend_capabilities

    model = _shard(_net(), "optim_grads_params")
    opt = _opt(model)
    _train(model, opt, 1, rows=_my_rows())
    _C.reset_collective_counts()
    sd, osd = model.state_dict(), opt.state_dict()
    counts = dict(_C.collective_counts())
    local = sum(p.detach().numel() for p in model.parameters())
    assert counts["all_to_all"][0] > 0, counts
    # Parameters and two moments: each rank sends its own elements once, plus the tiny
    # agreement on the optimizer's state keys; a gather would receive world x as much.
    assert counts["all_to_all"][1] <= 3 * local * 4, (counts, local)
    assert counts["all_gather"][1] < local, counts  # only small agreements, no unit gathered

    caps = _C.known_backend_caps("gloo", torch.device("cpu"))
    register_backend_capabilities("gloo", "cpu", coalesced_all_gather=True, coalesced_reduce_scatter=True,
                                  all_to_all=False)
    try:
        gathered = _shard(_net(seed=3), "optim_grads_params")
        gathered_opt = _opt(gathered)
        _train(gathered, gathered_opt, 1, rows=_my_rows())
        gathered.load_state_dict(sd)  # FSDP2-placed DTensors, cut by the gather path
        gathered_opt.load_state_dict(osd)
        assert not gathered.blocks[0]._fsdp_state.unit.exchanges_rows
        sd2, osd2 = gathered.state_dict(), gathered_opt.state_dict()
    finally:
        register_backend_capabilities("gloo", "cpu", coalesced_all_gather=caps.coalesced_all_gather,
                                      coalesced_reduce_scatter=caps.coalesced_reduce_scatter,
                                      all_to_all=caps.all_to_all)
    for key, value in sd.items():
        assert type(value) is type(sd2[key]), key
        if isinstance(value, DTensor):
            assert value.placements == sd2[key].placements and value.shape == sd2[key].shape, key
            assert torch.equal(value.to_local(), sd2[key].to_local()), key
    for key, entry in osd["state"].items():
        for name, value in entry.items():
            other = osd2["state"][key][name]
            got, want = (v.to_local() if isinstance(v, DTensor) else v for v in (other, value))
            assert torch.equal(got, want), (key, name)
    # Back through the exchange: the gathered model's DTensors load into a third model.
    third = _shard(_net(seed=5), "optim_grads_params")
    third.load_state_dict(sd2)
    for (name, p), q in zip(third.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    return True


def _keep_vars_as_fsdp2(rank, world):
    """state_dict(keep_vars=True) hands out nn.Parameters with each parameter's
    requires_grad, as torch and FSDP2 do (FSDP2's are the DTensor parameters themselves):
    `{k: v for k, v in sd.items() if v.requires_grad}` keeps the trainable entries, also
    through a submodule's own state_dict(). Values and placements equal FSDP2's; without
    keep_vars nothing requires grad. Ours are copies, so a write into one under no_grad
    reaches the parameter as a write into a plain state-dict value does."""
    models = {}
    for name, build in (("ours", lambda m: _shard(m, "optim_grads_params")), ("fsdp2", _fsdp2)):
        net = _net()
        net.blocks[0][0].requires_grad_(False)  # a frozen Linear inside a unit with trainable ones
        net.emb.weight.requires_grad_(False)    # and in the root's unit
        model = build(net)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        _train(model, opt, 1, rows=_my_rows())
        models[name] = model
    trainable = {}
    for name, model in models.items():
        for where, sd in (("model", model.state_dict(keep_vars=True)),
                          ("blocks.0", model.blocks[0].state_dict(keep_vars=True))):
            params = {k: v for k, v in sd.items() if isinstance(v, nn.Parameter)}
            assert set(params) == {k for k, _ in (model if where == "model" else model.blocks[0]).named_parameters()}, \
                (name, where, sorted(params))
            trainable[name, where] = sorted(k for k, v in sd.items() if v.requires_grad)
        plain = model.state_dict()
        assert not any(v.requires_grad or isinstance(v, nn.Parameter) for v in plain.values()), name
    for where in ("model", "blocks.0"):
        assert trainable["ours", where] == trainable["fsdp2", where], where
    assert "emb.weight" not in trainable["ours", "model"] and "blocks.0.0.weight" not in trainable["ours", "model"]
    assert "head.weight" in trainable["ours", "model"] and "2.weight" in trainable["ours", "blocks.0"]
    ours, theirs = models["ours"].state_dict(keep_vars=True), models["fsdp2"].state_dict(keep_vars=True)
    for key, value in theirs.items():
        if isinstance(value, DTensor):
            assert ours[key].placements == value.placements and ours[key].shape == value.shape, key
            torch.testing.assert_close(ours[key].full_tensor(), value.full_tensor(), **_tol(), msg=key)
    with torch.no_grad():
        for model, sd in ((models["ours"], ours), (models["fsdp2"], theirs)):
            sd["head.weight"].mul_(2.0)
    torch.testing.assert_close(models["ours"].state_dict()["head.weight"].full_tensor(),
                               models["fsdp2"].state_dict()["head.weight"].full_tensor(), **_tol())
    return True


def test_keep_vars_state_dict_hands_out_parameters_as_fsdp2():
    assert run_distributed(_keep_vars_as_fsdp2, 2, timeout=120) == [True, True]


@pytest.mark.gpu
@pytest.mark.nccl_only  # FSDP2's full_tensor() of CUDA DTensors needs NCCL
def test_keep_vars_state_dict_on_nccl():
    world = gpu_world()
    assert run_distributed(_keep_vars_as_fsdp2, world, backend="nccl", timeout=180) == [True] * world


def test_state_dict_rows_are_exchanged_not_gathered():
    assert run_distributed(_rows_exchanged_not_gathered, 3, timeout=120) == [True] * 3


def _strided_dtensor_loads(rank, world):
    """A DTensor placed as FSDP2 over tensor parallelism places dim 0 (_StridedShard) has
    the local shape of our rows but another element order: it must load its values (through
    torch's full_tensor), not be taken for our rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    strided = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2)])
    model = mfsdp.fully_shard(nn.Linear(4, 8, bias=False))
    assert tuple(strided.to_local().shape) == (8 // world, 4)  # the shape of our rows
    model.load_state_dict({"weight": strided})
    assert torch.equal(mfsdp.full_state_dict(model, rank0_only=False)["weight"], full)
    return True


def test_strided_dtensor_loads_its_values():
    assert run_distributed(_strided_dtensor_loads, 2, timeout=60) == [True, True]


@pytest.mark.gpu
@pytest.mark.nccl_only  # NCCL itself: one GPU per rank
def test_state_dict_helpers_and_dcp_on_nccl(tmp_path):
    """The same checks with NCCL and CUDA tensors (DeviceMesh on cuda, gathers on the GPU)."""
    world = gpu_world()
    assert run_distributed(_state_dicts_and_dcp, world, "optim_grads_params", str(tmp_path / "ckpt"),
                           backend="nccl", timeout=300) == [True] * world
