"""module.cpu() / module.to(device) after fully_shard, the way RL trainers (verl's
offload_fsdp_model_to_cpu / load_fsdp_model_to_gpu, NeMo-RL) park a sharded model in host
memory while the rollout engine holds the GPU: every rank's shards leave the device and
come back, the optimizer's state is moved by hand as they do, and training continues
exactly as a plain process that never moved (parameters and gradients every step)."""
import copy
from typing import Dict

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp

from .workers import ResidualTokenNet, device_for_backend, expect_error, flat_piece, gather_full_grads, rel_err

VOCAB, DIM, HIDDEN, BATCH, SEQ = 32, 16, 24, 4, 6


def _batch(step: int, rank: int, world: int, device):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g)
    return tokens.to(device), tokens[rank * BATCH:(rank + 1) * BATCH].to(device)


def _loss(model, tokens):
    return model(tokens).float().square().mean()


def _move_optimizer_state(opt, device) -> None:
    # verl's offload_fsdp_optimizer / load_fsdp_optimizer: every tensor of the state moves.
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    opt.state[p][key] = value.to(device)


def _full_values(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().double().cpu() for k, v in mfsdp.full_state_dict(model, rank0_only=False).items()}


def _park(model, device, spelling: str) -> None:
    """Move the model to `device` the way `spelling`'s trainer does."""
    if spelling == "verl":  # offload_fsdp_model_to_cpu / load_fsdp_model_to_gpu
        model.to(device)
    elif spelling == "swap":  # model.to with torch's swap_tensors conversion turned on
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to(device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    elif spelling == "nemo_rl":  # move_to_device: the buffers by swap_tensors, then model.to
        for buf in model.buffers():
            torch.utils.swap_tensors(buf, buf.to(device))
        model.to(device)
    else:  # "per_param", older verl: every parameter's .data on its own (the buffers stay)
        assert spelling == "per_param", spelling
        for p in model.parameters():
            p.data = p.data.to(device)


def park_and_resume(rank: int, world: int, strategy: str, spelling: str, keep_grads: bool) -> Dict:
    """Train 2 steps, park the model (and the optimizer state) on the host the way
    `spelling`'s trainer does, come back, train 2 more; against one plain process on every
    rank's rows. `keep_grads`: the model is parked between backward and the step, so its
    gradients travel too."""
    device = device_for_backend()
    host = torch.device("cpu")
    torch.manual_seed(0)
    plain = ResidualTokenNet(VOCAB, DIM, HIDDEN, depth=3).to(device)
    model = copy.deepcopy(plain)
    for block in model.blocks:
        mfsdp.fully_shard(block, sharding_strategy=strategy)
    mfsdp.fully_shard(model, sharding_strategy=strategy, reshard_after_forward=False)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    moved_bytes = 0
    for step in range(4):
        everything, mine = _batch(step, rank, world, device)
        ref_loss = _loss(plain, everything)
        ref_loss.backward()
        loss = _loss(model, mine)
        loss.backward()
        got = torch.tensor([loss.item()], dtype=torch.float64, device=device)
        dist.all_reduce(got)
        worst["loss"] = max(worst["loss"], abs(got.item() / world - ref_loss.item()) / abs(ref_loss.item()))
        if step == 2:  # the rollout phase: the model and its optimizer state leave the device
            if not keep_grads:
                opt.zero_grad()  # verl parks after its update: recompute below
            before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            units = [m._mfsdp_state.unit for m in model.modules() if "_mfsdp_state" in m.__dict__]
            shard_bytes = sum(u.sharded_flat.nbytes for u in units if u is not None)
            _park(model, host, spelling)
            if device.type == "cuda":
                moved_bytes = before - torch.cuda.memory_allocated()
                assert moved_bytes >= shard_bytes, (
                    f"model.cpu() freed {moved_bytes} bytes of the GPU's, less than this rank's {shard_bytes} of shards")
            _move_optimizer_state(opt, host)
            assert all(u.sharded_flat.device == host for u in units if u is not None), "a unit's shard stayed"
            for name, p in model.named_parameters():
                assert p.device == host, f"'{name}' is on {p.device} after model.cpu()"
                assert p.grad is None or p.grad.device == host, f"'{name}'.grad is on {p.grad.device} after model.cpu()"
            if device.type == "cuda":
                expect_error(lambda: model(mine), ValueError, "moved by module.to()", "move the model back")
            _park(model, device, spelling)
            _move_optimizer_state(opt, device)
            for name, p in model.named_parameters():
                assert p.device == device, f"'{name}' is on {p.device} after model.to({device})"
            if not keep_grads:
                _loss(model, mine).backward()
        grads = gather_full_grads(model, replicated=strategy == "no_shard")
        for name, p in plain.named_parameters():
            worst["grad"] = max(worst["grad"], rel_err(grads[name], flat_piece(p.grad)))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    full = _full_values(model)
    for name, p in plain.named_parameters():
        worst["param"] = max(worst["param"], rel_err(full[name], p.detach()))
    for key, tol in (("loss", 1e-5), ("grad", 1e-5), ("param", 1e-5)):
        assert worst[key] <= tol, f"{strategy}: {key} differs from one process by {worst[key]:.2e}: {worst}"
    return {"worst": worst, "moved_bytes": moved_bytes}


def moves_refused(rank: int, world: int) -> None:
    """What a device move cannot do is refused by name, and leaves the model as it was."""
    device = device_for_backend()
    torch.manual_seed(0)
    model = ResidualTokenNet(VOCAB, DIM, HIDDEN, depth=2).to(device)
    for block in model.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    before = _full_values(model)
    expect_error(lambda: model.to("meta"), RuntimeError, "the meta device", "fully_shard unit")
    after = _full_values(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused move changed the values"
    model.to(device)  # to where it already is: nothing moves, it still trains
    _, mine = _batch(0, rank, world, device)
    _loss(model, mine).backward()
    if device.type == "cuda":
        # A module inside a unit would take part of the unit's shard along: refused before
        # anything moves, and the model still trains where it is.
        expect_error(lambda: model.blocks[0][0].cpu(), RuntimeError, "cannot change its sharded parameters",
                     "on cpu")
        assert all(p.device == device for p in model.parameters())
        _loss(model, mine).backward()


def park_edge_cases(rank: int, world: int) -> None:
    """A model with a CPU-offloaded block, parked right after a forward whose backward
    never ran (the root, reshard_after_forward=False, still holds its gathered parameters):
    the offloaded block's shard and gradients stay in host memory, the rest moves and comes
    back, and the next steps equal one plain process's."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    device = device_for_backend()
    host = torch.device("cpu")
    torch.manual_seed(0)
    plain = ResidualTokenNet(VOCAB, DIM, HIDDEN, depth=3).to(device)
    model = copy.deepcopy(plain)
    for i, block in enumerate(model.blocks):
        mfsdp.fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if i == 1 else None)
    mfsdp.fully_shard(model, reshard_after_forward=False)
    offloaded = model.blocks[1]._fsdp_state.unit
    assert offloaded.offloaded
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    everything, mine = _batch(0, rank, world, device)
    _loss(model, mine)  # a forward whose backward never runs: the root stays gathered
    model.cpu()
    assert all(p.device == host for p in model.parameters())
    model.to(device)
    for name, p in model.named_parameters():
        want = host if name.startswith("blocks.1.") else device
        assert p.device == want, f"'{name}' on {p.device} after the round trip, not {want}"
    for step in range(2):
        everything, mine = _batch(step + 1, rank, world, device)
        _loss(plain, everything).backward()
        _loss(model, mine).backward()
        grads = gather_full_grads(model, replicated=False)
        for name, p in plain.named_parameters():
            err = rel_err(grads[name], flat_piece(p.grad))
            assert err <= 1e-5, f"step {step}: gradient of '{name}' differs from one process by {err:.2e}"
        if step == 0:  # parked with gradients: the offloaded block's stay on the host
            model.cpu()
            model.to(device)
            assert all(p.grad.device == host for p in model.blocks[1].parameters())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = _full_values(model)
    for name, p in plain.named_parameters():
        assert rel_err(full[name], p.detach()) <= 1e-5, f"'{name}' after training differs from one process"


def group_unit_moves(rank: int, world: int) -> None:
    """A unit of several modules (fully_shard([a, b])) moves with the conversion of a module
    above both (a plain parent, whose _apply reaches a's first), and is refused when only
    one of its modules is converted. The device change is simulated (retype's probe sees
    another device, the move itself is recorded), so the decision runs on any machine."""
    from megatron_fsdp_ext.core import retype

    moved = []
    real = retype._probe, retype._check_move, retype._move

    def probe(state, fn):  # another device until the unit "moved"
        got = real[0](state, fn)
        return None if got is None or state in moved else (got[0], torch.empty(0, device="meta"))

    retype._probe = probe
    retype._check_move = lambda state, device: True
    retype._move = lambda state, device: moved.append(state)
    try:
        parent = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        mfsdp.fully_shard([parent[0], parent[1]])
        parent.to(torch.float32)  # a conversion of the parent reaches both members
        assert len(moved) == 1, moved
        moved.clear()
        expect_error(lambda: parent[0].to(torch.float32), RuntimeError, "part of a unit of several modules",
                     "Linear")
        assert not moved
    finally:
        retype._probe, retype._check_move, retype._move = real
