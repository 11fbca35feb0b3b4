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
    def __init__(self, hidden=13):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(Block(hidden=hidden) for _ in range(2))
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


TP_HIDDEN = 16  # split evenly over 2 tp ranks


def _tensor_parallel(model, device_mesh):
    """Megatron's TP on each block (up column-, down row-parallel) over Lightning's
    "tensor_parallel" dim; the rest stays whole on every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in model.blocks:
        parallelize_module(b, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _tp_then_shard(model, device_mesh):
    return _shard(_tensor_parallel(model, device_mesh), device_mesh)


def tensor_parallel_empty_init_and_training(rank, world):
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) with TP and ours
    in its parallelize function, the model built under empty_init: Lightning's per-module
    to_empty and reset_parameters give the TP model alone's values (each TP shard drawn as
    a DTensor, as on that model); then, loaded with a plain Net()'s values, three steps
    with clip_gradients train as one plain process on the dp ranks' batches together.
    (FSDP2 fails here in the clip: torch's clip_grad_norm_ stacks norms of DTensors on the
    2-D (dp, tp) mesh and the 1-D dp mesh.)"""
    _as_torchrun(rank, world)
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dp, tp = world // 2, 2
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(
        _tp_then_shard, data_parallel_size=dp, tensor_parallel_size=tp))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Net(hidden=TP_HIDDEN)
    torch.manual_seed(0)
    model = fabric.setup(model)
    waiting = [n for n, p in model.named_parameters() if p.is_meta]
    assert not waiting, f"still waiting for values after Lightning's materialization: {waiting}"
    got = _values(model)

    with torch.device("meta"):
        alone = Net(hidden=TP_HIDDEN)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    _tensor_parallel(alone, mesh)
    torch.manual_seed(0)
    for m in alone.modules():  # Lightning's materialization, on the TP model alone
        if any(t.is_meta for t in m.parameters(recurse=False)):
            m.to_empty(device="cpu", recurse=False)
            m.reset_parameters()
    for k, v in alone.state_dict().items():
        want = v.full_tensor() if isinstance(v, DTensor) else v
        assert torch.equal(got[k], want), f"'{k}' after empty_init differs from the TP model alone"

    torch.manual_seed(3)
    plain = Net(hidden=TP_HIDDEN)
    set_model_state_dict(model.module, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    dp_rank = mesh["data_parallel"].get_local_rank()
    for step in range(3):
        batches = []
        for r in range(dp):
            g = torch.Generator().manual_seed(100 * step + r)
            batches.append((torch.randint(0, 11, (4, 3), generator=g), torch.randint(0, 5, (4,), generator=g)))
        x, y = batches[dp_rank]
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
        x_all, y_all = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        plain_loss = nn.functional.cross_entropy(plain(x_all), y_all)
        plain_loss.backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm=0.5)
        plain_opt.step()
        plain_opt.zero_grad()
        assert plain_norm > 0.5, "clipping was not active"
        assert abs(float(norm) - float(plain_norm)) <= 1e-5 * float(plain_norm), (step, float(norm), float(plain_norm))
    final = _values(model)
    for k, v in plain.state_dict().items():
        assert torch.allclose(final[k], v, rtol=1e-5, atol=1e-6), f"'{k}' after training differs from one process"
    return True
