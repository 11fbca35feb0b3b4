"""Workers of tests/distributed/test_accelerate_features.py: Hugging Face Accelerate's own
loop on its FSDP2 path (prepare, accumulate, backward, clip_grad_norm_, optimizer and
scheduler steps; accelerate_loop_workers' Run and model) under the options its
FSDP2 plugin and ParallelismConfig hand to fully_shard, ours patched in for torch's
(torch.distributed.fsdp.fully_shard = megatron_fsdp_ext.fully_shard, as a user swaps it)
against FSDP2 under the same plugin in the same processes:

- "no_reshard": FullyShardedDataParallelPlugin(reshard_after_forward=False), Accelerate's
  SHARD_GRAD_OP (ZeRO-2): fully_shard(reshard_after_forward=False) on every unit;
- "zero2": the same plugin with ours patched in as
  functools.partial(megatron_fsdp_ext.fully_shard, sharding_strategy="optim_grads") (our
  ZeRO-2 proper, which keeps the gathered parameters between steps), against FSDP2's
  reshard_after_forward=False (the same plugin: one FSDP2 run serves both);
- "offload": cpu_offload=True, which the plugin turns into CPUOffloadPolicy() (pinned; FSDP2
  cannot pin without an accelerator, so its run takes CPUOffloadPolicy(pin_memory=False));
- "hsdp": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) at world 4: Accelerate
  builds the (dp_replicate, dp_shard) mesh and passes fully_shard
  mesh[("dp_replicate", "dp_shard_cp")], a 2-D mesh.

Each run records one epoch (_epoch: every micro-batch's loss, at every step the full
gradients before clip_grad_norm_ and the norm it returns, the parameters after the last
step), then a probe (_probe) of where the option shows on the units: each unit's options,
offload flag, mesh and shard group size, which parameters the module slots hold and the
unsharded storage it keeps, before a forward, right after it (before its backward), after
the backward and after the optimizer step; and each parameter's local element count.

Accelerate 1.12 on CPU: it makes the job MULTI_CPU, which ignores the FSDP plugin (the job
is made FSDP after construction, as accelerate_loop_workers does) and refuses a
ParallelismConfig (given after that, as Accelerator.__init__ gives it). With transformers 5
it cannot run tensor parallelism, under FSDP2 as under ours: Accelerator._prepare_tp
imports transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5
no longer has."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import fully_shard as FSDP2_FULLY_SHARD

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .accelerate_loop_workers import (ACCUM, BATCH, MAX_NORM, Run, _full, _np, _reset_accelerate, llama,
                                      lr_lambda, train_data)
from .workers import torchrun_environment

SYSTEMS = ("fsdp2", "ours")
# name -> (plugin options, ParallelismConfig options or None, ours' extra fully_shard
# options). "hsdp" needs world 4, the others run at world 2.
CONFIGS = {
    "no_reshard": ({"reshard_after_forward": False}, None, {}),
    "zero2": ({"reshard_after_forward": False}, None, {"sharding_strategy": "optim_grads"}),
    "offload": ({"cpu_offload": True}, None, {}),
    "hsdp": ({}, {"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
}
# Configs whose FSDP2 run is another's (the same plugin): compared with that one.
SHARED_REFERENCE = {"zero2": "no_reshard"}
# FSDP2 cannot pin its offloaded shards without an accelerator: under cpu_offload=True
# (CPUOffloadPolicy(), pin_memory=True) its fully_shard raises this on a CPU-only machine,
# and the reference runs with cpu_offload=CPUOffloadPolicy(pin_memory=False) instead.
FSDP2_PIN_ERROR = "Cannot access accelerator device when none is available"


def _accelerator(plugin_options: dict, parallelism: dict | None):
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin
    world, rank = dist.get_world_size(), dist.get_rank()
    torchrun_environment(rank, world, OMP_NUM_THREADS="1")
    options = dict(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                   transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT")
    options.update(plugin_options)
    plugin = FullyShardedDataParallelPlugin(**options)
    acc = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=plugin,
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=ACCUM))
    # On CPU Accelerate makes the job MULTI_CPU and ignores the plugin: made FSDP as in
    # accelerate_loop_workers (prepare and the loop then run the FSDP2 code unchanged).
    if acc.distributed_type != DistributedType.FSDP:
        acc.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    if parallelism is not None:
        # Accelerator(parallelism_config=...) refuses MULTI_CPU (ParallelismConfig.
        # _validate_accelerator: "only compatible DistributedType.FSDP (version 2) or
        # DistributedType.Multi{Device}"): given after the fix above, with the two lines
        # Accelerator.__init__ runs for it (the mesh on the CPU, the same check).
        pc = ParallelismConfig(**parallelism)
        acc.state.parallelism_config = pc
        acc.state.device_mesh = pc.get_device_mesh(acc.device.type)
        pc._validate_accelerator(acc)
    assert acc.is_fsdp2 and acc.num_processes == world and acc.process_index == rank
    return acc


class FeatureRun(Run):
    """Run (accelerate_loop_workers) with the plugin and ParallelismConfig of one CONFIGS
    entry; ours patched in with that entry's extra fully_shard options."""

    def __init__(self, system: str, name: str, seed: int = 0, plugin_override: dict | None = None):
        from torch.utils.data import DataLoader
        plugin_options, parallelism, ours_options = CONFIGS[name]
        plugin_options = {**plugin_options, **(plugin_override or {})}
        torch_fsdp.fully_shard = (functools.partial(mfsdp.fully_shard, **ours_options) if system == "ours"
                                  else FSDP2_FULLY_SHARD)
        self.system, self.rank = system, dist.get_rank()
        self.acc = _accelerator(plugin_options, parallelism)
        model = llama(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        train = DataLoader(train_data(), batch_size=BATCH, shuffle=False)
        self.model, self.opt, self.sched, self.train = self.acc.prepare(model, opt, sched, train)
        sharded_as = mfsdp.FSDPModule if system == "ours" else torch_fsdp.FSDPModule
        assert isinstance(self.model, sharded_as) and isinstance(self.model.model.layers[0], sharded_as)


def _unit_facts(model) -> list:
    """Per unit of ours (module order, root first): what fully_shard's options became."""
    out = []
    for s in iter_states(model):
        u = s.unit
        out.append({
            "label": s.label, "is_root": s.is_root,
            "reshard_after_forward": s.options.reshard_after_forward,
            "sharding_strategy": s.options.sharding_strategy,
            "offloaded": bool(u.offloaded),
            "mesh": None if s.device_mesh is None else [list(s.device_mesh.mesh_dim_names),
                                                         list(s.device_mesh.mesh.shape)],
            "shard_group_size": dist.get_world_size(s.process_group),
            "slots": s.slots_hold.value,
            "unsharded_bytes": int(u.unsharded_storage_bytes),
        })
    return out


def _fsdp2_facts(model) -> list:
    """Per FSDP2 unit: the options its param group holds."""
    out = []
    for m in model.modules():
        if not isinstance(m, torch_fsdp.FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        out.append({
            "reshard_after_forward": group.post_forward_mesh_info is not None,
            "offload": type(group.offload_policy).__name__,
            "mesh": [list(group.mesh_info.mesh.mesh_dim_names or ()), list(group.mesh_info.mesh.mesh.shape)],
            "unsharded": group.is_unsharded,
        })
    return out


def _probe(run: FeatureRun) -> dict:
    """After the loop: the units right after a forward (before its backward), after the
    backward and after an optimizer step; the local shard sizes of the parameters."""
    facts = _unit_facts if run.system == "ours" else _fsdp2_facts
    ids = train_data()[:BATCH]
    out = {"before": facts(run.model)}
    loss = run.model(input_ids=ids, labels=ids).loss
    out["after_forward"] = facts(run.model)
    loss.backward()
    out["after_backward"] = facts(run.model)
    run.opt.step()
    run.opt.zero_grad()
    out["after_step"] = facts(run.model)
    out["local_numel"] = {n: (p.to_local() if hasattr(p, "to_local") else p).numel()
                          for n, p in run.model.named_parameters()}
    return out


def _epoch(run: FeatureRun, rec: dict) -> None:
    """One pass over the train dataloader as a typical Accelerate script writes it
    (Run.epoch without its evaluations): every micro-batch's loss; at each optimizer step
    the full gradients before clip_grad_norm_ (rank 0) and its returned norm (every rank);
    the full parameters after the last step (rank 0)."""
    acc, model = run.acc, run.model
    for ids in run.train:
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            rec["losses"].append(loss.item())
            if acc.sync_gradients:
                grads = {n: _np(_full(p.grad)) for n, p in model.named_parameters()}
                norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM).item()
                rec["steps"].append({"grad_pre": grads, "norm": norm} if run.rank == 0 else {"norm": norm})
            run.opt.step()
            run.sched.step()
            run.opt.zero_grad()
    params = run.full_params()
    if run.rank == 0:
        rec["params"] = params


def accelerate_features(rank: int, world: int, names) -> dict:
    """For each CONFIGS name (of this world size) and each system (FSDP2's once per
    plugin: not for SHARED_REFERENCE's names): one epoch of the loop
    (3 optimizer steps of ACCUM micro-batches at world 2; at world 4, 2 steps: ACCUM
    micro-batches, then the last one alone), then _probe."""
    out = {}
    for name in names:
        for system in SYSTEMS:
            if system == "fsdp2" and name in SHARED_REFERENCE:
                continue
            rec = {"losses": [], "steps": []}
            try:
                run = FeatureRun(system, name)
            except RuntimeError as e:
                if not (system == "fsdp2" and name == "offload" and FSDP2_PIN_ERROR in str(e)):
                    raise
                _reset_accelerate()
                rec["fsdp2_error"] = str(e)
                run = FeatureRun(system, name, plugin_override={"cpu_offload": torch_fsdp.CPUOffloadPolicy(
                    pin_memory=False)})
            rec["plugin"] = {"reshard_after_forward": run.acc.state.fsdp_plugin.reshard_after_forward,
                             "cpu_offload": repr(run.acc.state.fsdp_plugin.cpu_offload)}
            try:
                _epoch(run, rec)
                rec["probe"] = _probe(run)
            finally:
                run.close()
            out[(name, system)] = rec
    return out
