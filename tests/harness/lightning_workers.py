"""Workers of tests/distributed/test_lightning.py: Lightning Fabric's ModelParallelStrategy
(the user calls fully_shard in its parallelize function) saving and resuming a model sharded
by ours, as with FSDP2. Each rank runs inside run_distributed's process group; Lightning
reads torchrun's environment, so it launches nothing and joins that group."""
import os

import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp

from .workers import _full, torchrun_environment


class Block(nn.Module):
    def __init__(self, dim=8, hidden=13):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h):
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.emb(x).mean(1)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _shard(model, device_mesh):
    mesh = device_mesh["data_parallel"]
    for b in model.blocks:
        mfsdp.fully_shard(b, mesh=mesh)
    return mfsdp.fully_shard(model, mesh=mesh)


def _as_torchrun(rank, world):
    # Lightning takes a job with TORCHELASTIC_RUN_ID and a master address for torchrun's.
    torchrun_environment(rank, world, GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29599",
                         TORCHELASTIC_RUN_ID="mfsdp")


def _steps(fabric, model, opt, first, count):
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x, y = torch.randint(0, 11, (4, 3), generator=g), torch.randint(0, 5, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _values(model):
    return {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def save_and_resume(rank, world, folder, distributed):
    """Train 2 steps, fabric.save, train 2 more; a fresh model and optimizer (another seed)
    fabric.load the checkpoint and train the same 2 steps: every value and loss as in the
    uninterrupted run. `distributed`: DCP's sharded checkpoint, else one full file."""
    _as_torchrun(rank, world)
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(
        _shard, data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=distributed))
    fabric.launch()
    path = os.path.join(folder, "ckpt" if distributed else "ckpt.pt")

    torch.manual_seed(0)
    model = fabric.setup(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _steps(fabric, model, opt, 0, 2)
    saved = _values(model)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    after = _steps(fabric, model, opt, 2, 2)
    want = _values(model)

    torch.manual_seed(1)
    fresh = fabric.setup(Net())
    fresh_opt = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 2
    got = _values(fresh)
    assert all(torch.equal(got[k], saved[k]) for k in saved), "the loaded model differs from the saved one"
    resumed = _steps(fabric, fresh, fresh_opt, 2, 2)
    assert resumed == after, (resumed, after)  # the optimizer state came back too
    final = _values(fresh)
    assert all(torch.equal(final[k], want[k]) for k in want)
    return True


def empty_init_is_a_plain_init(rank, world):
    """Lightning's empty_init: the model is built on the meta device, sharded by ours in the
    parallelize function, then Lightning materializes what is meta (to_empty, then every
    module's reset_parameters). The values are a plain Net()'s of the same seed, and training
    from them is the run built without empty_init, step for step."""
    _as_torchrun(rank, world)
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(
        _shard, data_parallel_size=world, tensor_parallel_size=1))
    fabric.launch()
    runs = []
    for empty_init in (True, False):
        torch.manual_seed(0)
        with fabric.init_module(empty_init=empty_init):
            model = Net()
        assert all(p.is_meta for p in model.parameters()) == empty_init
        torch.manual_seed(0)  # reset_parameters draws from here, as Net() does
        model = fabric.setup(model)
        assert not any(p.is_meta for p in model.parameters())
        if empty_init:
            torch.manual_seed(0)
            plain = Net().state_dict()
            got = _values(model)
            assert all(torch.equal(got[k], v) for k, v in plain.items()), "materialized values differ from Net()'s"
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        runs.append((_steps(fabric, model, opt, 0, 3), _values(model)))
    (meta_losses, meta_params), (losses, params) = runs
    assert meta_losses == losses, (meta_losses, losses)
    assert all(torch.equal(meta_params[k], params[k]) for k in params)
    return True
