"""Workers of tests/distributed/test_lightning_features.py: Lightning's ModelParallelStrategy
with the features of the README's matrix, the user's code Lightning's own: Fabric with a
parallelize function that calls fully_shard (ours, or torch's FSDP2 as the reference) with
the option, or the Trainer with a LightningModule's configure_model.

Fabric: each config trains the same SGD steps (lr LR, no momentum) with the same
per-rank batches under FSDP2 (where FSDP2 has the setting) and ours, and one plain process
on the ranks' batches together (the global batch) whenever the run is fp32. Per step: the
loss (ranks' mean), the norm fabric.clip_gradients returns, the full gradient the
optimizer applies (p.grad after the clip, gathered) and the full values after the step.
Each run also records, from the system's own state, that the option reached every unit
(ours: the unit states; FSDP2: its param groups)."""
from __future__ import annotations

import os
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.param_index import iter_states

from .fp8_workers import bf16_policy, fp8_gathered, fp8_gathered_names
from .lightning_workers import Net, _as_torchrun, _values
from .workers import _full, rel_err

LR = 0.5
BATCH = 4  # rows per rank and micro-step
# bf16-true with the norm clip: the two systems' bf16 clip norms may lie one bf16 ulp apart
# (2**-7 relative at 1.19: FSDP2 1.1953125, ours 1.1875, the fp64 norm of the same bf16
# gradients 1.19041), so the clip coefficients differ by up to 0.8% and the bf16 values
# after the step by an ulp here and there: measured 1.8e-2 on the gradients, 1.6e-2 on the values.
BF16_TOL = 3e-2
BF16_ULP = 2.0 ** -7
BUCKET = 2200  # bytes: both blocks' gathered fp32 parameters (2 x 980) share a bucket, the root's (532) not
# The FP8 configs' blocks (dim 8 -> FP8_HIDDEN -> 8): dim-0 shards even at world 2, where
# FSDP2 + torchao's FP8 gather can run (it aborts on uneven shards, see test_fp8.py).
FP8_HIDDEN = 16


def float8(model: nn.Module) -> nn.Module:
    """torchao's FP8 training on the blocks' Linears, their weights gathered in FP8;
    embedding and head stay."""
    return fp8_gathered(model, module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))


# ---------------------------------------------------------------- the parallelize function


def _fsdp2_groups(module) -> List:
    state = module._get_fsdp_state()
    return list(state._fsdp_param_groups) if state._fsdp_param_groups else []


def _parallelize(impl: str, cfg: Dict, record: Dict):
    """The user's parallelize function: fully_shard each block, then the root, with the
    config's option, on Lightning's "data_parallel" mesh (or a mesh built from its ranks:
    HSDP's (replicate, shard), FSDP2's no-shard (world, 1)); compile each block in place
    after sharding, as Lightning's docs do; "fp8": torchao's conversion first, bf16
    parameters. `record` gets the compile backend."""

    def parallelize(model, device_mesh):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        if impl == "ours":
            shard = mfsdp.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as shard
        mesh = device_mesh["data_parallel"]
        kw, root_kw = {}, {}
        feature = cfg["feature"]
        if feature == "zero2":
            kw["reshard_after_forward"] = False
            root_kw["reshard_after_forward"] = False
        elif feature in ("zero1", "no_shard"):
            if impl == "ours":
                kw["sharding_strategy"] = root_kw["sharding_strategy"] = "optim" if feature == "zero1" else "no_shard"
            else:  # FSDP2's replication: HSDP over shard groups of one rank
                assert feature == "no_shard", f"FSDP2 has no {feature}"
                kw["mesh"] = root_kw["mesh"] = init_device_mesh("cpu", (mesh.size(), 1),
                                                                mesh_dim_names=("replicate", "shard"))
        elif feature == "hsdp":
            kw["mesh"] = root_kw["mesh"] = init_device_mesh("cpu", (2, mesh.size() // 2),
                                                            mesh_dim_names=("replicate", "shard"))
        elif feature == "offload":
            kw["offload_policy"] = root_kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        elif feature == "fp8":  # converted here, before fully_shard, as torchtitan orders it
            float8(model)
            kw["mp_policy"] = root_kw["mp_policy"] = bf16_policy(impl)
        if impl == "ours" and feature in ("buckets", "zero3"):
            nbytes = BUCKET if feature == "buckets" else 0
            root_kw.update(gather_bucket_bytes=nbytes, reduce_bucket_bytes=nbytes)
        kw.setdefault("mesh", mesh)
        root_kw.setdefault("mesh", mesh)
        for b in model.blocks:
            shard(b, **kw)
        shard(model, **root_kw)
        if feature == "compile":
            from .moe_feature_workers import RecordingBackend

            record["backend"] = RecordingBackend()
            for b in model.blocks:
                b.compile(backend=record["backend"], fullgraph=True)
        return model

    return parallelize


# ---------------------------------------------------------------- what each system says


def option_on_units(impl: str, model, feature: str) -> List:
    """Per unit (the two blocks, the root), the option as the system holds it."""
    net = model.module if hasattr(model, "module") else model
    if impl == "ours":
        states = list(iter_states(net))
        assert len(states) == 3, states
        out = []
        for s in states:
            if feature == "zero2":
                out.append(s.reshard_after_forward is False)
            elif feature in ("zero1", "no_shard"):
                out.append(s.options.sharding_strategy == ("optim" if feature == "zero1" else "no_shard"))
            elif feature == "offload":
                out.append(bool(s.unit.offloaded) and s.unit.sharded_flat.device.type == "cpu")
            elif feature == "hsdp":
                out.append(all(tuple(p.device_mesh.mesh_dim_names) == ("replicate", "shard")
                               and p.device_mesh.shape == (2, 2) for p in s.sharded_params))
            elif feature == "fp8":  # the blocks' weights gathered in FP8, nothing else
                fp8 = fp8_gathered_names(s.unit)
                want = ["down.weight", "up.weight"] if s.module is not net else []
                out.append(fp8 == want and bool(s.unit.gathers_bytes) == bool(want)
                           and s.unit.param_dtype == torch.bfloat16)
            else:
                out.append(True)
        return out
    from torch.distributed.fsdp import CPUOffloadPolicy

    out = []
    for m in (*net.blocks, net):
        groups = _fsdp2_groups(m)
        assert len(groups) == 1, groups
        g = groups[0]
        if feature == "zero2":
            out.append(g.post_forward_mesh_info is None)
        elif feature == "offload":
            out.append(isinstance(g.offload_policy, CPUOffloadPolicy)
                       and all(p._sharded_local_tensor.device.type == "cpu" for p in g.fsdp_params))
        elif feature in ("hsdp", "no_shard"):
            want = (2, 2) if feature == "hsdp" else (dist.get_world_size(), 1)
            out.append(tuple(g.mesh_info.mesh.mesh_dim_names) == ("replicate", "shard")
                       and tuple(g.mesh_info.mesh.shape) == want)
        elif feature == "fp8":  # torchao's FP8-gathering weights, the blocks' only
            fp8 = sorted(p._param_fqn.rsplit(".", 2)[-2] + ".weight" for p in g.fsdp_params
                         if type(p.sharded_param._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor")
            out.append(fp8 == (["down.weight", "up.weight"] if m is not net else [])
                       and g.mp_policy.param_dtype == torch.bfloat16)
        else:
            out.append(True)
    return out


def unsharded_after_forward(impl: str, model) -> List[bool]:
    """Per block, between forward and backward: are its parameters still gathered."""
    net = model.module if hasattr(model, "module") else model
    if impl == "ours":
        return [b._fsdp_state.unit.state != b._fsdp_state.unit.state.SHARDED for b in net.blocks]
    return [_fsdp2_groups(b)[0].is_unsharded for b in net.blocks]


# ---------------------------------------------------------------- training


def _batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 11, (BATCH, 3), generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _global_batch(step: int, micro: int, world: int):
    parts = [_batch(step, micro, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _clip_kwargs(cfg: Dict) -> Dict:
    clip = cfg.get("clip")
    if clip is None:
        return {}
    kind, value = clip
    return {"max_norm": value} if kind == "norm" else {"clip_val": value}


def fabric_run(impl: str, rank: int, world: int, cfg: Dict, steps: int) -> Dict:
    """Fabric(strategy=ModelParallelStrategy(parallelize), precision=cfg's) trains `steps`
    SGD steps of `accum` micro-batches each (the first accum - 1 under
    fabric.no_backward_sync(model, enabled=cfg's no_sync)), clipping with
    fabric.clip_gradients if cfg says so; "fp8": Net(hidden=FP8_HIDDEN), torchao's
    precompute_float8_dynamic_scale_for_fsdp after each optimizer step."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    torch._dynamo.reset()
    record = {}
    fabric = L.Fabric(accelerator="cpu", devices=world, precision=cfg.get("precision", "32-true"),
                      strategy=ModelParallelStrategy(_parallelize(impl, cfg, record), data_parallel_size=world,
                                                     tensor_parallel_size=1))
    fabric.launch()
    fp8 = cfg["feature"] == "fp8"
    torch.manual_seed(0)
    model = fabric.setup(Net(hidden=FP8_HIDDEN) if fp8 else Net())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    weight_types = []  # fp8: per step, the types of the weights the blocks' Linears saw in forward
    if fp8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        from torchao.float8.float8_linear import Float8Linear

        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.register_forward_pre_hook(lambda mod, args: weight_types[-1].add(type(mod.weight).__name__))
    if impl == "fsdp2":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM / AVG
    accum = cfg.get("accum", 1)
    start = _values(model)
    losses, norms, grads, values, unsharded, counts = [], [], [], [], [], []
    for step in range(steps):
        before_counts = dict(_C.collective_counts())
        total = torch.zeros((), dtype=torch.float64)
        weight_types.append(set())
        for micro in range(accum):
            x, y = _batch(step, micro, rank)
            with fabric.no_backward_sync(model, enabled=cfg.get("no_sync", True) and micro < accum - 1):
                out = model(x)
                if micro == 0:
                    unsharded.append(unsharded_after_forward(impl, model))
                loss = nn.functional.cross_entropy(out.float(), y) / accum
                fabric.backward(loss)
            total += loss.detach().double()
        counts.append({k: v[0] - before_counts[k][0] for k, v in _C.collective_counts().items()})
        norm = None
        if cfg.get("clip"):
            norm = fabric.clip_gradients(model, opt, **_clip_kwargs(cfg))
        # The gradient the optimizer applies (after the clip), full.
        grads.append({k: _full(p.grad).detach().double().clone() for k, p in model.module.named_parameters()})
        opt.step()
        if fp8:  # torchao's scales for the next gathers (its recipe; ours: a no-op)
            precompute_float8_dynamic_scale_for_fsdp(model)
        opt.zero_grad()
        values.append(_values(model))
        dist.all_reduce(total)
        losses.append((total / world).item())
        if norm is not None:
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            norms.append(float(norm))
    out = {"losses": losses, "norms": norms, "grads": grads, "values": values, "params": values[-1], "start": start,
           "option": option_on_units(impl, model, cfg["feature"]), "unsharded": unsharded, "counts": counts,
           "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "weight_types": [sorted(t) for t in weight_types]}
    if impl == "ours":
        out["budgets"] = tuple(model.module.bucket_budgets())
    if "backend" in record:
        out["graphs"] = (record["backend"].graphs, record["backend"].calls)
    return out


def plain_run(world: int, cfg: Dict, steps: int) -> Dict:
    """One process, no Lightning: Net() of seed 0 on the global batches, the same SGD,
    accumulation and clipping (torch.nn.utils' clip_grad_norm_ / clip_grad_value_)."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    accum = cfg.get("accum", 1)
    losses, norms, grads, values = [], [], [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = _global_batch(step, micro, world)
            loss = nn.functional.cross_entropy(net(x), y) / accum
            loss.backward()
            total += loss.item()
        clip = cfg.get("clip")
        if clip and clip[0] == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip[1])))
        elif clip:
            torch.nn.utils.clip_grad_value_(net.parameters(), clip[1])
        grads.append({k: p.grad.detach().double().clone() for k, p in net.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(total)
        values.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return {"losses": losses, "norms": norms, "grads": grads, "values": values, "params": values[-1]}


def worst(ours: Dict, ref: Dict) -> Dict[str, float]:
    """The largest relative difference of each step's loss, clip norm, full gradients and
    values after the step (or after the last step only, where a run has no "values")."""
    out = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "param": 0.0}
    assert len(ours["losses"]) == len(ref["losses"]) and len(ours["norms"]) == len(ref["norms"])
    for a, b in zip(ours["losses"], ref["losses"]):
        out["loss"] = max(out["loss"], abs(a - b) / abs(b))
    for a, b in zip(ours["norms"], ref["norms"]):
        out["norm"] = max(out["norm"], abs(a - b) / abs(b))
    for g, want in zip(ours["grads"], ref["grads"]):
        assert g.keys() == want.keys(), (sorted(g), sorted(want))
        out["grad"] = max(out["grad"], max(rel_err(g[k], want[k]) for k in want))
    for got, want in zip(ours.get("values", [ours["params"]]), ref.get("values", [ref["params"]])):
        out["param"] = max(out["param"], max(rel_err(got[k], v) for k, v in want.items()))
    return out


def _summary(run: Dict) -> Dict:
    moved = max(rel_err(run["params"][k], v) for k, v in run["start"].items())
    return {k: run[k] for k in ("option", "unsharded", "counts", "dtypes", "norms", "budgets", "graphs",
                                "weight_types") if k in run} | {"moved": moved}


def fabric_features(rank: int, world: int, configs: List[Dict], steps: int = 3) -> Dict[str, Dict]:
    """Each config ({"name", "feature", "fsdp2", "plain", "precision", "accum", "no_sync",
    "clip"}) under FSDP2 (unless fsdp2=False) and ours, and one plain process (unless
    plain=False); per config the worst differences of ours against each and what each
    system's units said."""
    _as_torchrun(rank, world)
    results = {}
    for cfg in configs:
        runs = {}
        if cfg.get("fsdp2", True):
            runs["fsdp2"] = fabric_run("fsdp2", rank, world, cfg, steps)
        runs["ours"] = fabric_run("ours", rank, world, cfg, steps)
        out = {impl: _summary(r) for impl, r in runs.items()}
        if "fsdp2" in runs:
            out["vs_fsdp2"] = worst(runs["ours"], runs["fsdp2"])
        if cfg.get("plain", True):
            ref = plain_run(world, cfg, steps)
            out["vs_plain"] = {impl: worst(r, ref) for impl, r in runs.items()}
            out["plain_norms"] = ref["norms"]
        results[cfg["name"]] = out
    return results


# ---------------------------------------------------------------- the Trainer

TRAINER_LR = 0.5
MICRO_PER_EPOCH = 4  # micro-batches per rank and epoch; accumulate_grad_batches=2: 2 optimizer steps
ACCUM = 2


def _lit_sgd_class():
    """lightning_trainer_workers' LitNet with SGD."""
    from .lightning_trainer_workers import _lit_class

    LitNet = _lit_class()

    class LitSGD(LitNet):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=TRAINER_LR)

    return LitSGD


def _trainer_dataset(world: int):
    g = torch.Generator().manual_seed(4321)
    n = world * BATCH * MICRO_PER_EPOCH
    return torch.utils.data.TensorDataset(torch.randint(0, 11, (n, 3), generator=g),
                                          torch.randint(0, 5, (n,), generator=g))


def _after_steps_class():
    import lightning.pytorch as pl

    class AfterSteps(pl.Callback):
        """The model's full values when training starts and after each optimizer step, and
        the full gradients each step applied (after the clip; Lightning zeroes them at the
        start of the next accumulation window)."""

        def __init__(self):
            self.values, self.grads, self.last_step = [], [], 0

        def on_train_start(self, trainer, module):
            self.values.append(_values(module.net))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step != self.last_step:
                self.last_step = trainer.global_step
                self.values.append(_values(module.net))
                self.grads.append({k: _full(p.grad).detach().double().clone()
                                   for k, p in module.net.named_parameters()})

    return AfterSteps


def _trainer_fit(world: int, folder: str, impl: str, algorithm: str, clip: float, epochs: int,
                 lit_class=None) -> Dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    AfterSteps = _after_steps_class()
    seen = AfterSteps()
    model = (lit_class or _lit_sgd_class())(impl)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_epochs=epochs, accumulate_grad_batches=ACCUM, gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm, logger=False, callbacks=[seen], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=folder)
    loader = torch.utils.data.DataLoader(_trainer_dataset(world), batch_size=BATCH, shuffle=False)
    trainer.fit(model, loader)
    steps = epochs * MICRO_PER_EPOCH // ACCUM
    assert trainer.global_step == steps, trainer.global_step
    assert len(seen.values) == steps + 1 and len(seen.grads) == steps, (len(seen.values), len(seen.grads))
    micro = torch.stack(model.losses).double()
    dist.all_reduce(micro)
    return {"losses": (micro / world).tolist(), "norms": [], "grads": seen.grads, "values": seen.values[1:],
            "params": seen.values[-1],
            "start": seen.values[0], "model": model}


def _trainer_plain(world: int, algorithm: str, clip: float, epochs: int) -> Dict:
    """One process on the global micro-batches in the Trainer's DistributedSampler order
    (lightning_trainer_workers' docstring): the loss of each micro-batch, each optimizer
    step's gradient (the mean of ACCUM micro-batches, clipped), the values after."""
    from .lightning_trainer_workers import _sampler_seed

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=TRAINER_LR)
    data = _trainer_dataset(world)
    losses, grads, norms, values, clipped = [], [], [], [], 0
    for epoch in range(epochs):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(_sampler_seed() + epoch))
        for s in range(MICRO_PER_EPOCH):
            rows = torch.cat([perm[r::world][BATCH * s:BATCH * (s + 1)] for r in range(world)])
            x, y = data[rows]
            loss = nn.functional.cross_entropy(net(x), y)
            (loss / ACCUM).backward()
            losses.append(loss.item())
            if (s + 1) % ACCUM:
                continue
            if algorithm == "norm":
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
            else:
                clipped += sum(int((p.grad.abs() > clip).sum()) for p in net.parameters())
                torch.nn.utils.clip_grad_value_(net.parameters(), clip)
            grads.append({k: p.grad.detach().double().clone() for k, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
            values.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return {"losses": losses, "norms": [], "grads": grads, "clip_norms": norms, "clipped": clipped,
            "values": values, "params": values[-1]}


def trainer_accumulate_and_clip(rank: int, world: int, folder: str, clips: Dict[str, float],
                                epochs: int = 2) -> Dict[str, Dict]:
    """Trainer.fit with accumulate_grad_batches=ACCUM and gradient_clip_algorithm
    "norm" / "value" (clips: algorithm -> gradient_clip_val), ours and FSDP2 in
    configure_model; per algorithm the worst differences of ours against FSDP2 and of both
    against the plain run, and how often the plain run's clipping acted."""
    _as_torchrun(rank, world)
    results = {}
    for algorithm, clip in clips.items():
        runs = {impl: _trainer_fit(world, os.path.join(folder, f"{impl}_{algorithm}"), impl, algorithm, clip, epochs)
                for impl in ("fsdp2", "ours")}
        ref = _trainer_plain(world, algorithm, clip, epochs)
        results[algorithm] = {
            "vs_fsdp2": worst(runs["ours"], runs["fsdp2"]),
            "vs_plain": {impl: worst(r, ref) for impl, r in runs.items()},
            "steps": len(ref["grads"]), "micro": len(ref["losses"]),
            "plain_clip_norms": ref["clip_norms"], "plain_clipped": ref["clipped"],
            "moved": max(rel_err(runs["ours"]["params"][k], v) for k, v in runs["ours"]["start"].items()),
            "sharded": all(hasattr(p, "full_tensor") for p in runs["ours"]["model"].net.parameters())
            and bool(list(iter_states(runs["ours"]["model"].net)))}
    return results


# ---------------------------------------------------------------- the Trainer with torchao's FP8 gather


def _lit_fp8_class():
    """LitSGD whose configure_model converts the blocks' Linears with torchao's FP8 gather
    (float8) and shards with bf16 parameters, and whose optimizer_step is followed by
    torchao's precompute_float8_dynamic_scale_for_fsdp (its recipe; ours: a no-op); the
    types of the weights the Float8Linears saw in forward are recorded per micro-batch."""
    LitSGD = _lit_sgd_class()

    class LitFP8(LitSGD):
        def __init__(self, impl):
            super().__init__(impl)
            torch.manual_seed(0)
            self.net = Net(hidden=FP8_HIDDEN)
            self.weight_types = []

        def configure_model(self):
            from torchao.float8.float8_linear import Float8Linear

            from .lightning_trainer_workers import _shard

            float8(self.net)  # before fully_shard, as torchtitan orders it
            _shard(self.net, self.device_mesh["data_parallel"], self.impl, mp_policy=bf16_policy(self.impl))
            for m in self.net.modules():
                if isinstance(m, Float8Linear):
                    m.register_forward_pre_hook(lambda mod, args: self.weight_types.append(type(mod.weight).__name__))

        def optimizer_step(self, *args, **kwargs):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            super().optimizer_step(*args, **kwargs)
            precompute_float8_dynamic_scale_for_fsdp(self.net)

    return LitFP8


def trainer_fp8_vs_fsdp2(rank: int, world: int, folder: str, algorithm: str, clip: float, epochs: int = 2) -> Dict:
    """Trainer.fit with accumulate_grad_batches=ACCUM and gradient_clip_algorithm=`algorithm`,
    the LightningModule of _lit_fp8_class sharded by ours and by FSDP2 (both + torchao's
    FP8 gather): the worst differences of ours against FSDP2 (each micro-batch's loss, each
    step's clipped full gradients and the values after it), the types of the weights
    each system's Float8Linears saw in forward, what the units gather in FP8 (ours) or ask
    to (FSDP2's), and how many gradient elements ours' clip by value cut to the bound."""
    _as_torchrun(rank, world)
    LitFP8 = _lit_fp8_class()
    runs = {impl: _trainer_fit(world, os.path.join(folder, impl), impl, algorithm, clip, epochs, LitFP8)
            for impl in ("fsdp2", "ours")}
    net = runs["ours"]["model"].net
    return {"vs_fsdp2": worst(runs["ours"], runs["fsdp2"]), "steps": len(runs["ours"]["grads"]),
            "micro": len(runs["ours"]["losses"]),
            "moved": max(rel_err(runs["ours"]["params"][k], v) for k, v in runs["ours"]["start"].items()),
            "weight_types": {impl: sorted(set(r["model"].weight_types)) for impl, r in runs.items()},
            "forwards": {impl: len(r["model"].weight_types) for impl, r in runs.items()},
            "option": {impl: option_on_units(impl, r["model"].net, "fp8") for impl, r in runs.items()},
            "clipped": sum(int((g.abs() == float(torch.tensor(clip))).sum())  # the fp32 bound
                           for step in runs["ours"]["grads"] for g in step.values()),
            "sharded": all(hasattr(p, "full_tensor") for p in net.parameters())}
