"""Workers of tests/distributed/test_lightning.py's Trainer tests: Lightning's Trainer
with ModelParallelStrategy, the LightningModule's configure_model sharding its network with
ours or torch's FSDP2 fully_shard. Each rank runs inside run_distributed's Gloo process group; torchrun's
environment (harness.lightning_workers._as_torchrun) makes Lightning take the job for a
torchrun one: it launches nothing and joins that group.

Data: one global dataset. For training the Trainer always puts a DistributedSampler on
each rank's DataLoader, shuffling (seed PL_GLOBAL_SEED, default 0; set_epoch each epoch):
rank r's batch s of epoch e holds samples perm_e[r::world][4s:4s+4], so the ranks' batches
at step s together are perm_e[8s:8s+8] (world 2). The single-process plain reference
trains on those global batches: the mean of the ranks' losses is its loss, the ranks'
averaged gradient its gradient."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp

from .lightning_workers import Net, _as_torchrun, _values

PER_RANK_BATCH = 4
STEPS_PER_EPOCH = 2
LR = 1e-2
CLIP = 0.7  # below the plain run's gradient norm at some steps (0.58-0.95): clipping acts
IMPLS = ("ours", "fsdp2")
# Sharded runs vs the one-process run on the global batch: the reductions differ in order
# (a mean of two means vs one mean; summed shards), a few 1e-7 after a few AdamW steps.
PLAIN_RTOL = 5e-6


# ---------------------------------------------------------------- model and Trainer


def _shard(net, mesh, impl, **kwargs):
    """Each block, then the root, by `impl`'s fully_shard (kwargs: its other arguments)."""
    if impl == "ours":
        shard = mfsdp.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for b in net.blocks:
        shard(b, mesh=mesh, **kwargs)
    shard(net, mesh=mesh, **kwargs)


_LIT = None


def _lit_class():
    """The LightningModule, built on first use: lightning is imported only after
    _as_torchrun (its rank_zero_only reads the rank from the environment at import)."""
    global _LIT
    if _LIT is None:
        import lightning.pytorch as pl

        class LitNet(pl.LightningModule):
            """Net() of `seed` (on the meta device under trainer.init_module(empty_init=True)),
            sharded by `impl` in configure_model; records each step's loss. `init_seed`:
            the seed the generator is set to after sharding, right before the strategy
            materializes what is meta (to_empty, then every module's reset_parameters())."""

            def __init__(self, impl, seed=0, init_seed=None):
                super().__init__()
                torch.manual_seed(seed)
                self.net = Net()
                self.impl = impl
                self.init_seed = init_seed
                self.losses = []

            def configure_model(self):
                _shard(self.net, self.device_mesh["data_parallel"], self.impl)
                if self.init_seed is not None:
                    torch.manual_seed(self.init_seed)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = nn.functional.cross_entropy(self.net(x), y)
                self.losses.append(loss.detach().clone())
                return loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=LR)

        _LIT = LitNet
    return _LIT


def _dataset(world):
    g = torch.Generator().manual_seed(1234)
    n = world * PER_RANK_BATCH * STEPS_PER_EPOCH
    return torch.utils.data.TensorDataset(torch.randint(0, 11, (n, 3), generator=g),
                                          torch.randint(0, 5, (n,), generator=g))


def _sampler_seed():
    return int(os.getenv("PL_GLOBAL_SEED", 0))  # as lightning's _get_distributed_sampler


def _loader(world):
    # The Trainer replaces the sampler by a shuffling DistributedSampler.
    return torch.utils.data.DataLoader(_dataset(world), batch_size=PER_RANK_BATCH, shuffle=False)


def _trainer(world, folder, epochs, distributed=True, callbacks=()):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    return pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                       save_distributed_checkpoint=distributed),
        max_epochs=epochs, gradient_clip_val=CLIP, logger=False, callbacks=list(callbacks),
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=folder)


def _losses(model):
    return torch.stack(model.losses).double()


def _mean_over_ranks(t):
    t = t.clone()
    dist.all_reduce(t)  # Gloo: no AVG
    return t / dist.get_world_size()


# ---------------------------------------------------------------- comparisons


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _check_close(got, want, what, rtol):
    """Every tensor of `got` within `rtol` of `want`'s, relative to its largest magnitude;
    returns the largest such error."""
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    worst = 0.0
    for k in want:
        assert got[k].shape == want[k].shape, (what, k, got[k].shape, want[k].shape)
        assert torch.isfinite(got[k]).all(), f"{what}: {k} is not finite: {got[k]}"
        err = _rel(got[k], want[k])
        assert err <= rtol, f"{what}: {k} differs by {err:.3g} relative (> {rtol}):\n{got[k]}\n{want[k]}"
        worst = max(worst, err)
    return worst


def _check_losses(got, want, what, rtol):
    assert got.shape == want.shape, (what, got, want)
    err = ((got - want).abs() / want.abs()).max().item()
    assert err <= rtol, f"{what}: losses differ by {err:.3g} relative (> {rtol}):\n{got.tolist()}\n{want.tolist()}"
    return err


def _bitwise(got, want):
    if isinstance(got, dict):
        return all(torch.equal(got[k], want[k]) for k in want)
    return torch.equal(got, want)


# ---------------------------------------------------------------- the single-process reference


def _plain_run(world, epochs, seed=0):
    """One process, no Lightning: Net() of `seed` trained on the global batches with the
    same AdamW, clipping and step count. Its loss is the mean of the ranks' losses."""
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    data = _dataset(world)
    global_batch = PER_RANK_BATCH * world
    losses, norms = [], []
    for epoch in range(epochs):
        # DistributedSampler(shuffle=True)'s permutation of this epoch, as the Trainer's.
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(_sampler_seed() + epoch))
        for s in range(STEPS_PER_EPOCH):
            x, y = data[perm[s * global_batch:(s + 1) * global_batch]]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
            opt.step()
            losses.append(loss.detach().double())
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), f"clipping should act at some steps: {norms}"
    return torch.stack(losses), {k: v.detach().clone() for k, v in net.state_dict().items()}


def _fit(world, folder, impl, epochs, **kw):
    model = _lit_class()(impl)
    trainer = _trainer(world, folder, epochs)
    trainer.fit(model, _loader(world), **kw)
    assert trainer.global_step == epochs * STEPS_PER_EPOCH, trainer.global_step
    return model, trainer


# ---------------------------------------------------------------- workers


def fit_matches_fsdp2_and_plain(rank, world, folder, epochs):
    """Trainer.fit with ours and with FSDP2 in configure_model: the same per-step losses
    (each rank's own) and final full parameters; both as the single-process plain run's."""
    _as_torchrun(rank, world)
    runs = {}
    for impl in IMPLS:
        model, _ = _fit(world, os.path.join(folder, impl), impl, epochs)
        sharded = [p for p in model.net.parameters()]
        assert sharded and all(hasattr(p, "full_tensor") for p in sharded), f"{impl}: not sharded"
        runs[impl] = (_losses(model), _values(model.net))
    (ours_l, ours_p), (ref_l, ref_p) = runs["ours"], runs["fsdp2"]
    stats = {"steps": len(ours_l)}
    stats["loss_vs_fsdp2"] = _check_losses(ours_l, ref_l, "ours vs FSDP2", 1e-6)
    stats["param_vs_fsdp2"] = _check_close(ours_p, ref_p, "ours vs FSDP2", 1e-6)
    stats["bitwise_vs_fsdp2"] = _bitwise(ours_l, ref_l) and _bitwise(ours_p, ref_p)
    plain_l, plain_p = _plain_run(world, epochs)
    for impl, (losses, params) in runs.items():
        stats[f"loss_{impl}_vs_plain"] = _check_losses(_mean_over_ranks(losses), plain_l, f"{impl} vs plain",
                                                       PLAIN_RTOL)
        stats[f"param_{impl}_vs_plain"] = _check_close(params, plain_p, f"{impl} vs plain", PLAIN_RTOL)
    return stats


def _snapshot_class():
    import lightning.pytorch as pl

    class Snapshots(pl.Callback):
        """The model's full values when training starts (after materialization and any
        checkpoint restore) and at each training epoch's end (where ModelCheckpoint saves)."""

        def __init__(self):
            self.start, self.epoch_end = None, []

        def on_train_start(self, trainer, module):
            self.start = _values(module.net)

        def on_train_epoch_end(self, trainer, module):
            self.epoch_end.append(_values(module.net))

    return Snapshots


def resume_matches_uninterrupted(rank, world, folder, distributed, epochs):
    """An uninterrupted fit of `epochs` epochs saves a checkpoint at each epoch's end
    (ModelCheckpoint; DCP folders if `distributed`, else one full file); a fresh Trainer and
    a fresh model of another seed fit(ckpt_path=) the first epoch's: the loaded values are
    the saved ones, and every later loss (each rank's) and the final values are the
    uninterrupted run's, bit for bit (the AdamW state came back too). With ours, and with
    FSDP2 as the control that Lightning itself resumes exactly; ours and FSDP2 alike."""
    _as_torchrun(rank, world)
    from lightning.pytorch.callbacks import ModelCheckpoint

    Snapshots, LitNet = _snapshot_class(), _lit_class()
    results = {}
    for impl in IMPLS:
        where = os.path.join(folder, impl)
        saver, seen = ModelCheckpoint(dirpath=where, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                                      save_on_train_epoch_end=True), Snapshots()
        model = LitNet(impl, seed=0)
        trainer = _trainer(world, where, epochs, distributed, callbacks=[saver, seen])
        trainer.fit(model, _loader(world))
        assert trainer.global_step == epochs * STEPS_PER_EPOCH
        path = os.path.join(where, "epoch=0.ckpt")
        dist.barrier()
        assert (os.path.isdir if distributed else os.path.isfile)(path), (path, os.listdir(where))

        fresh, seen_again = LitNet(impl, seed=1), Snapshots()
        assert not _bitwise(_values(fresh.net), seen.epoch_end[0]), "the fresh model must start elsewhere"
        resumer = _trainer(world, where, epochs, distributed, callbacks=[seen_again])
        resumer.fit(fresh, _loader(world), ckpt_path=path)
        assert resumer.current_epoch == epochs and resumer.global_step == epochs * STEPS_PER_EPOCH, \
            (resumer.current_epoch, resumer.global_step)
        assert seen_again.start is not None, f"{impl}: the resumed fit did not train"
        _check_close(seen_again.start, seen.epoch_end[0], f"{impl}: loaded vs saved", 0.0)
        resumed, uninterrupted = _losses(fresh), _losses(model)[STEPS_PER_EPOCH:]
        assert torch.equal(resumed, uninterrupted), \
            f"{impl}: resumed losses {resumed.tolist()} != uninterrupted {uninterrupted.tolist()}"
        final = _values(fresh.net)
        _check_close(final, seen.epoch_end[-1], f"{impl}: resumed vs uninterrupted final values", 0.0)
        results[impl] = (_losses(model), resumed, final)
    stats = {"steps_resumed": len(results["ours"][1])}
    stats["loss_vs_fsdp2"] = _check_losses(results["ours"][1], results["fsdp2"][1], "resumed, ours vs FSDP2", 1e-6)
    stats["param_vs_fsdp2"] = _check_close(results["ours"][2], results["fsdp2"][2], "resumed, ours vs FSDP2", 1e-6)
    stats["bitwise_vs_fsdp2"] = _bitwise(results["ours"][1], results["fsdp2"][1]) and \
        _bitwise(results["ours"][2], results["fsdp2"][2])
    return stats


def empty_init_matches_plain_init(rank, world, folder, epochs):
    """Under trainer.init_module(empty_init=True) the LightningModule's Net is built on the
    meta device; configure_model shards it with ours and sets the generator to seed 0, and
    the strategy's setup materializes it (to_empty, then every module's reset_parameters()).
    The materialized full values are a plain Net()'s of seed 0 bit for bit, and training
    from them is ours' fit built without empty_init, loss for loss and bit for bit, and
    FSDP2's fit built without empty_init within 1e-6. (FSDP2 with empty_init is no
    reference: its reset_parameters() draws each rank's DTensor shard from the same
    generator, so its values are not a plain Net()'s; see the report.)"""
    _as_torchrun(rank, world)
    Snapshots, LitNet = _snapshot_class(), _lit_class()
    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    runs = {}
    for impl, empty_init in (("ours", True), ("ours", False), ("fsdp2", False)):
        seen = Snapshots()
        trainer = _trainer(world, os.path.join(folder, impl), epochs, callbacks=[seen])
        with trainer.init_module(empty_init=empty_init):
            model = LitNet(impl, seed=0, init_seed=0)
        assert all(p.is_meta for p in model.parameters()) == empty_init
        trainer.fit(model, _loader(world))
        assert trainer.global_step == epochs * STEPS_PER_EPOCH
        assert not any(p.is_meta for p in model.parameters()), f"{impl}: meta parameters after fit"
        _check_close(seen.start, plain, f"{impl}, empty_init={empty_init}: initial values vs a plain Net()'s", 0.0)
        runs[impl, empty_init] = (_losses(model), _values(model.net))
    (meta_l, meta_p), (l, p) = runs["ours", True], runs["ours", False]
    assert torch.equal(meta_l, l), f"ours: empty_init losses {meta_l.tolist()} != {l.tolist()}"
    _check_close(meta_p, p, "ours: final values, empty_init vs not", 0.0)
    ref_l, ref_p = runs["fsdp2", False]
    return {"loss_vs_fsdp2": _check_losses(meta_l, ref_l, "ours with empty_init vs FSDP2", 1e-6),
            "param_vs_fsdp2": _check_close(meta_p, ref_p, "ours with empty_init vs FSDP2", 1e-6)}
