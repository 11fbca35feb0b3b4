"""Workers of FSDP2's reshard_after_forward=int (tests/distributed/test_post_forward_reshard.py
on Gloo CPU, tests/gpu/test_post_forward_reshard_gpu.py with CUDA tensors): after forward a
unit keeps 1/N of its gathered parameters and backward gathers over N ranks; the training
is FSDP2's with the same int and bit for bit ours with reshard_after_forward=True."""
import warnings

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp_ext as mfsdp

from .observe import count_collectives
from .workers import _full, device_for_backend, expect_error


class Block(nn.Module):
    def __init__(self, dim=24, hidden=37):  # sizes that leave padding in the flat layout
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks=3, dim=24):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 4)

    def forward(self, x, reuse_first=False, detach_last=False):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if reuse_first and i == 0:
                h = b(h)  # one unit used twice in a forward: its second use gathers from its kept copy
        if detach_last:  # the last block runs forward with grad, and its backward never comes
            h = h.detach()
        return self.head(h)


def _net(device):
    torch.manual_seed(0)
    return Net().to(device)


def _shard(shard, model, **kwargs):
    for b in model.blocks:
        shard(b, **kwargs)
    return shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def _batch(step, device):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g).to(device)


def _piece(t):
    """This rank's values as a plain tensor (our pieces; no collective)."""
    return t.detach().as_subclass(torch.Tensor).clone()


def _train(model, device, steps=3, reuse_first=False, forward_without_backward=False, full=True):
    """Losses, gradients of every step and parameters at the end: full values, or this
    rank's pieces (`full=False`: no DTensor collective, which torch's Gloo lacks for CUDA
    tensors). Gradients are compared, not only parameters: a wrong gathered value changes
    them first."""
    get = _full if full else _piece
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        loss = model(_batch(step, device), reuse_first=reuse_first).pow(2).mean()
        loss.backward()
        grads.append({n: get(p.grad).detach().clone() for n, p in model.named_parameters()})
        if forward_without_backward:
            model(_batch(step + 50, device)).sum()  # copies kept now are stale after the step below
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if full:
        params = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
    else:
        params = {n: _piece(p) for n, p in model.named_parameters()}
    return losses, grads, params


def _units(model):
    return [b._mfsdp_state.unit for b in model.blocks]


def _check_kept_after_forward(model, device, n):
    """Between forward and backward each block keeps exactly 1/N of its gathered buffer;
    backward gathers every block over N ranks from it, and nothing is kept after."""
    units = _units(model)
    model(_batch(5, device)).pow(2).mean().backward()  # the first step records the order buckets follow
    model.zero_grad()
    with count_collectives() as forward_counts:
        loss = model(_batch(7, device)).pow(2).mean()
    for u in units:
        assert u.post_forward_size == n
        assert u.unsharded_storage_bytes == 0
        assert u.post_forward_nbytes * n == u.unsharded_nbytes, (u.post_forward_nbytes, u.unsharded_nbytes)
    assert forward_counts.get("all_gather_post_forward", 0) == 0
    with count_collectives() as backward_counts:
        loss.backward()
    assert backward_counts.get("all_gather_post_forward", 0) == len(units), backward_counts
    assert backward_counts.get("all_gather", 0) == 0, backward_counts  # no block gathered over the whole group
    assert all(u.post_forward_nbytes == 0 for u in units)
    model.zero_grad()
    model(_batch(6, device), detach_last=True).pow(2).mean().backward()
    assert units[-1].post_forward_nbytes == 0  # released at the end of the backward that did not use it
    model.zero_grad()
    with torch.no_grad():  # no backward follows: nothing kept
        model(_batch(8, device))
    assert all(u.post_forward_nbytes == 0 and u.unsharded_storage_bytes == 0 for u in units)
    # A forward whose backward never comes keeps the copies until the next use (or
    # the end of a later backward), as FSDP2's post-forward parameters stay.
    model(_batch(9, device)).sum()
    assert all(u.post_forward_nbytes * n == u.unsharded_nbytes for u in units)


def trains_like_fsdp2_and_like_true(rank, world, n, hsdp=False, bucket_bytes=0, with_fsdp2=True):
    """Ours with reshard_after_forward=n against FSDP2 with the same n (within fp32
    reduction-order noise) and against ours with True (bit for bit: only where the
    backward's gathered values come from changes). `with_fsdp2=False`: the second only,
    on pieces (CUDA tensors over Gloo, where torch's own collectives are missing)."""
    device = device_for_backend()
    if hsdp:
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    ours = dict(mesh=mesh, gather_bucket_bytes=bucket_bytes, reduce_bucket_bytes=bucket_bytes)
    # The third case is checked against ours with True only: a forward with grad whose
    # backward never comes, then an optimizer step. FSDP2 2.13 gathers the next forward
    # from the post-forward copy made before that step (its losses differ from FSDP2 with
    # True from the next step on); ours drops a copy the shard has moved past.
    for reuse_first, forward_without_backward in ((False, False), (True, False), (False, True)):
        runs = {}
        systems = [("ours_int", mfsdp.fully_shard, dict(ours, reshard_after_forward=n)),
                   ("ours_true", mfsdp.fully_shard, dict(ours, reshard_after_forward=True))]
        if with_fsdp2 and not forward_without_backward:
            systems.append(("fsdp2_int", torch_fsdp.fully_shard, dict(mesh=mesh, reshard_after_forward=n)))
        for name, shard, kwargs in systems:
            model = _shard(shard, _net(device), **kwargs)
            if name == "ours_int":
                _check_kept_after_forward(model, device, n)
                model = _shard(shard, _net(device), **kwargs)
            runs[name] = _train(model, device, reuse_first=reuse_first,
                                forward_without_backward=forward_without_backward, full=with_fsdp2)
        (li, gi, pi), (lt, gt, pt) = runs["ours_int"], runs["ours_true"]
        assert li == lt, (li, lt)
        for a, b in zip(gi, gt):
            for k in a:
                assert torch.equal(a[k], b[k]), k
        assert all(torch.equal(pi[k], pt[k]) for k in pi)
        if "fsdp2_int" not in runs:
            continue
        lf, gf, pf = runs["fsdp2_int"]
        torch.testing.assert_close(torch.tensor(li), torch.tensor(lf), rtol=1e-6, atol=1e-7)
        for a, b in zip(gi, gf):
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)
        for k in pi:
            torch.testing.assert_close(pi[k], pf[k], rtol=1e-5, atol=1e-7, msg=k)
    return True


def arguments(rank, world):
    """What FSDP2 accepts and refuses for the int form, read the same way."""
    device = device_for_backend()
    expect_error(lambda: mfsdp.fully_shard(_net(device).blocks[0], reshard_after_forward=3), ValueError,
                 "reshard_after_forward=3", f"factor of the shard group's size {world}")
    expect_error(lambda: mfsdp.fully_shard(_net(device).blocks[0], reshard_after_forward="2"), TypeError,
                 "must be a bool, an int or None")
    expect_error(lambda: mfsdp.fully_shard(_net(device).blocks[0], reshard_after_forward=2,
                                           sharding_strategy="optim_grads"), ValueError, "contradicts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = mfsdp.fully_shard(_net(device).blocks[0], reshard_after_forward=1)
    assert any("reshard_after_forward=1" in str(w.message) for w in caught)
    assert one._mfsdp_state.options.reshard_after_forward is False
    # A whole-unit dtype change before the first forward (Accelerate's model.to(float32))
    # builds the units again: they keep their post-forward groups.
    converted = _shard(mfsdp.fully_shard, _net(device), reshard_after_forward=2).to(torch.float64)
    assert all(u.post_forward_size == 2 and u.param_dtype == torch.float64 for u in _units(converted))
    whole = mfsdp.fully_shard(_net(device).blocks[0], reshard_after_forward=world)
    assert whole._mfsdp_state.unit.post_forward_size == 0  # the whole group: True
    # FSDP2's setter takes a bool, which replaces the int: nothing is kept after forward then.
    model = _shard(mfsdp.fully_shard, _net(device), reshard_after_forward=2)
    model.set_reshard_after_forward(True)
    model(_batch(1, device)).sum()  # no backward: a kept copy would stay until the next use
    assert all(u.post_forward_nbytes == 0 and u.post_forward_size == 2 for u in _units(model))
    return True


def sizes_of_other_meshes(rank, world):
    """World 4: a unit's companion on another mesh (shard_placement_fn, as MoE experts on
    their mesh) takes the int by its own size: covered whole it reshards as True, and a
    size the int does not divide is refused naming that mesh, as FSDP2 refuses it."""
    device = device_for_backend()
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    pairs = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("a", "b"))["b"]
    flat = init_device_mesh(device.type, (world,))

    def on_pairs(p):  # the weights on a mesh of world/2 ranks, the biases on the whole group
        return ShardPlacementResult(Shard(0), FSDPMeshInfo(pairs, shard_mesh_dim=0)) if p.dim() == 2 else None

    block = mfsdp.fully_shard(_net(device).blocks[0], mesh=flat, reshard_after_forward=world // 2,
                              shard_placement_fn=on_pairs)
    state = block._mfsdp_state
    assert state.unit.post_forward_size == world // 2
    assert [c.unit.post_forward_size for c in state.companions] == [0]
    block(torch.randn(3, 24, device=device)).sum().backward()
    expect_error(lambda: mfsdp.fully_shard(_net(device).blocks[0], mesh=flat, reshard_after_forward=world,
                                           shard_placement_fn=on_pairs),
                 ValueError, f"reshard_after_forward={world}", "mesh ('b',)", f"sharded over {world // 2} ranks")
    return True
