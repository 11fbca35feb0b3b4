"""FSDP2's unit of several modules, fully_shard([norm, head]) as torchtitan shards its
dense models: one unit gathered before the first member runs and released after the
last. Checked on Gloo against a single-process plain model (same seed, same data):
per-step losses, every reduced gradient shard and the parameters; the state dict's keys
and values; the misuses refused."""
import pytest
import torch
import torch.nn as nn

from harness import run_distributed

STEPS, ROWS, WIDTH, VOCAB = 3, 4, 16, 32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def _batches(world):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS * world, 8), generator=g) for _ in range(STEPS)]


def _loss(net, tokens):
    logits = net(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _group_parity(rank, world, reshard_after_forward, path):
    import megatron_fsdp_ext as mfsdp
    from megatron_fsdp_ext.core.param_index import owner_of

    torch.manual_seed(0)
    ref = Net()
    net = Net()
    net.load_state_dict(ref.state_dict())
    for block in net.blocks:
        mfsdp.fully_shard(block, reshard_after_forward=reshard_after_forward)
    returned = mfsdp.fully_shard([net.norm, net.head], reshard_after_forward=reshard_after_forward)
    assert isinstance(returned, list) and returned[0] is net.norm and returned[1] is net.head
    mfsdp.fully_shard(net)
    group = net.norm._fsdp_state
    assert net.head._fsdp_state is group and len(group.sharded_params) == 4, group
    assert isinstance(net.head, mfsdp.FSDPModule)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    owners = [(p, *owner_of(p)) for p in net.parameters()]
    ref_by_name = dict(ref.named_parameters())
    names = {id(p): n for n, p in net.named_parameters()}
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    losses = []
    for tokens in _batches(world):
        loss = _loss(net, tokens[rows])
        # Released after its last member's forward (and gathered again for backward), or
        # kept until backward: never gathered per member.
        held = group.unit.unsharded_storage_bytes
        assert (held == 0) == reshard_after_forward, (held, reshard_after_forward)
        loss.backward()
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        # Every reduced gradient shard against this rank's piece of the full reference gradient.
        for p, state, i in owners:
            expected = state.unit.local_piece(i, ref_by_name[names[id(p)]].grad)
            torch.testing.assert_close(p.grad.to_local(), expected, rtol=1e-5, atol=1e-6, msg=names[id(p)])
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append((mean.item() / world, ref_loss.item()))
        assert group.slots_hold.name == "SHARDED", "the group unit must be released after its last member"
    for got, want in losses:
        assert abs(got - want) < 1e-5, losses
    full = mfsdp.full_state_dict(net, rank0_only=False)
    assert set(full) == set(ref.state_dict()), set(full) ^ set(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # torch's own protocol: DTensor entries under the plain keys; loading them back into a
    # fresh sharded model gives the same full values.
    sd = net.state_dict()
    assert set(sd) == set(ref.state_dict())
    again = Net()
    for block in again.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard([again.norm, again.head])
    mfsdp.fully_shard(again)
    again.load_state_dict(sd)
    reloaded = mfsdp.full_state_dict(again, rank0_only=False)
    for key, value in full.items():
        torch.testing.assert_close(reloaded[key], value, msg=key)
    # Our sharded checkpoint, model and optimizer, into a fresh model of the same units.
    mfsdp.save_checkpoint(path, net, opt)
    third = Net()
    for block in third.blocks:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard([third.norm, third.head])
    mfsdp.fully_shard(third)
    third_opt = torch.optim.AdamW(third.parameters(), lr=1e-2)
    mfsdp.load_checkpoint(path, third, third_opt)
    loaded = mfsdp.full_state_dict(third, rank0_only=False)
    for key, value in full.items():
        torch.testing.assert_close(loaded[key], value, msg=key)
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_unit_of_several_modules_trains_like_plain_pytorch(reshard_after_forward, tmp_path):
    results = run_distributed(_group_parity, 2, reshard_after_forward, str(tmp_path / "ckpt"), timeout=180)
    assert results[0] == results[1]


def _group_misuse(rank, world):
    import megatron_fsdp_ext as mfsdp
    from harness.workers import expect_error

    net = Net()
    expect_error(lambda: mfsdp.fully_shard([]), ValueError, "empty list")
    expect_error(lambda: mfsdp.fully_shard([net.norm, net.norm]), ValueError, "same module twice")
    expect_error(lambda: mfsdp.fully_shard([net.blocks, net.blocks[0]]), ValueError, "inside ModuleList")
    expect_error(lambda: mfsdp.fully_shard([net.norm, "head"]), TypeError, "got str")
    # A unit of several modules is not a root: forward on its members without a sharded parent.
    lone = Net()
    mfsdp.fully_shard([lone.norm, lone.head])
    expect_error(lambda: lone(torch.zeros(2, 4, dtype=torch.long)), ValueError, "would be the root",
                 "common parent")
    mfsdp.fully_shard(net.norm)
    expect_error(lambda: mfsdp.fully_shard([net.norm, net.head]), ValueError, "already called")


def test_unit_of_several_modules_refuses_misuse():
    run_distributed(_group_misuse, 2, timeout=120)


def _against_fsdp2(rank, world):
    import megatron_fsdp_ext as mfsdp
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    for shard, net in ((mfsdp.fully_shard, ours), (fsdp2_shard, theirs)):
        for block in net.blocks:
            shard(block)
        shard([net.norm, net.head])
        shard(net)
    opts = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in (ours, theirs)]
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    losses = []
    for tokens in _batches(world):
        step = []
        for net, opt in zip((ours, theirs), opts):
            loss = _loss(net, tokens[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(loss.item())
        losses.append(step)
    for a, b in losses:
        assert abs(a - b) < 1e-5, losses
    # The same DTensor placements and full values under torch's protocol.
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert set(sd_ours) == set(sd_theirs)
    for key in ("norm.weight", "head.weight", "head.bias"):
        a, b = sd_ours[key], sd_theirs[key]
        assert isinstance(a, DTensor) and a.placements == b.placements, (key, a.placements, b.placements)
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6, msg=key)
    return losses


def test_unit_of_several_modules_matches_fsdp2():
    run_distributed(_against_fsdp2, 2, timeout=180)
