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
  mesh[("dp_replicate", "dp_shard_cp")], a 2-D mesh;
- "buckets": the default plugin, ours as partial(fully_shard, gather_bucket_bytes=
  BUCKET_BYTES, reduce_bucket_bytes=BUCKET_BYTES) (the root and layer 0 share a bucket)
  against FSDP2's default;
- "zero1" / "no_shard": ours as partial(fully_shard, sharding_strategy="optim" /
  "no_shard") under reshard_after_forward=False, against FSDP2's "no_reshard" run (the
  default plugin's reshard_after_forward=True with ZeRO-1 is refused by name: recorded);
- "compile": Accelerator(dynamo_backend="AOT_EAGER"): Accelerate's FSDP2 path compiles
  the whole model, then shards the layers and the compiled module; against FSDP2's
  eager default ("buckets"' FSDP2 run: compiling FSDP2 too cost ~40 s of the launch);
- "bf16": Accelerator(mixed_precision="bf16"): the plugin's bf16 MixedPrecisionPolicy
  (AcceleratorState sets it for an FSDP job; here after construction, see below) and
  Accelerate's autocast around the forward;
- "fp8": Accelerate's own torchao FP8 path, Accelerator(mixed_precision="fp8",
  kwargs_handlers=[AORecipeKwargs(config=Float8LinearConfig(
  enable_fsdp_float8_all_gather=True))]): prepare converts the model's Linears (all but the
  first and the last, its default filter) to Float8Linear whose weights ask for the FP8
  all-gather, registers torchao's precompute_float8_dynamic_scale_for_fsdp as an
  optimizer step post-hook, then shards; the plugin's policy is "fp8"'s (bf16 params,
  reductions and outputs) and the forward runs under bf16 autocast.

Each run records one epoch (_epoch: every micro-batch's loss, at every step the full
gradients before clip_grad_norm_ and the norm it returns, the parameters after the last
step), then a probe (_probe) of where the option shows on the units: each unit's options,
offload flag, mesh and shard group size, which parameters the module slots hold and the
unsharded storage it keeps, before a forward, right after it (before its backward), after
the backward and after the optimizer step; and each parameter's local element count.
The epoch also records acc.gather and acc.reduce("mean") of every micro-batch's loss;
the Dynamo graphs made (compile); for SAVE_PRETRAINED's configs, what
unwrap_model(model).save_pretrained(state_dict=acc.get_state_dict(model)) wrote; for
ours, the buckets and the reduce-scatter calls of the probe's backward.

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
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard as FSDP2_FULLY_SHARD

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .accelerate_loop_workers import (ACCUM, BATCH, MAX_NORM, Run, _full, _np, _reset_accelerate, llama,
                                      lr_lambda, train_data)
from .fp8_workers import fp8_gathered_names
from .observe import schedule_buckets
from .workers import torchrun_environment

SYSTEMS = ("fsdp2", "ours")
# name -> (plugin options, ParallelismConfig options or None, ours' extra fully_shard
# options). "hsdp" needs world 4, the others run at world 2.
CONFIGS = {
    "no_reshard": ({"reshard_after_forward": False}, None, {}),
    "zero2": ({"reshard_after_forward": False}, None, {"sharding_strategy": "optim_grads"}),
    "offload": ({"cpu_offload": True}, None, {}),
    "hsdp": ({}, {"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
    # The default plugin; ours with explicit buckets (BUCKET_BYTES) against FSDP2's default.
    "buckets": ({}, None, {"gather_bucket_bytes": None, "reduce_bucket_bytes": None}),
    # ZeRO-1 and no shard keep their parameters: the plugin must not ask for a reshard
    # (its default reshard_after_forward=True is refused by name: REFUSED_DEFAULT_PLUGIN).
    "zero1": ({"reshard_after_forward": False}, None, {"sharding_strategy": "optim"}),
    "no_shard": ({"reshard_after_forward": False}, None, {"sharding_strategy": "no_shard"}),
    "compile": ({}, None, {}),
    "bf16": ({}, None, {}),
    "fp8": ({}, None, {}),
}
# Accelerator options of a config (besides cpu=True and the accumulation plugin).
ACCELERATOR_OPTIONS = {"compile": {"dynamo_backend": "AOT_EAGER"}, "bf16": {"mixed_precision": "bf16"},
                       "fp8": {"mixed_precision": "fp8"}}  # with torchao's FP8 all-gather: _accelerator
# Configs whose FSDP2 run is another's (the same plugin): compared with that one.
SHARED_REFERENCE = {"zero2": "no_reshard", "zero1": "no_reshard", "no_shard": "no_reshard",
                    # FSDP2 eager under the default plugin (compiling FSDP2 too doubled the
                    # launch's time; aot_eager computes as eager here, within 1e-6)
                    "compile": "buckets"}
# fully_shard's refusal when the default plugin (reshard_after_forward=True) meets ZeRO-1.
REFUSED_DEFAULT_PLUGIN = "reshard_after_forward=True contradicts sharding_strategy='optim'"
# The root + layer 0 (16448 + 36992 fp32 elements: 214 kB) share a bucket, layer 1 is
# another: in forward order, gathers and reductions alike.
BUCKET_BYTES = 220_000
# Configs that also save through unwrap_model(...).save_pretrained(state_dict=get_state_dict()).
SAVE_PRETRAINED = ("no_reshard", "buckets", "zero1", "no_shard", "compile", "bf16", "fp8")
# FSDP2 cannot pin its offloaded shards without an accelerator: under cpu_offload=True
# (CPUOffloadPolicy(), pin_memory=True) its fully_shard raises this on a CPU-only machine,
# and the reference runs with cpu_offload=CPUOffloadPolicy(pin_memory=False) instead.
FSDP2_PIN_ERROR = "Cannot access accelerator device when none is available"


def _accelerator(plugin_options: dict, parallelism: dict | None, accelerator_options: dict | None = None):
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin
    world, rank = dist.get_world_size(), dist.get_rank()
    torchrun_environment(rank, world, OMP_NUM_THREADS="1")
    options = dict(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                   transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT")
    options.update(plugin_options)
    plugin = FullyShardedDataParallelPlugin(**options)
    accelerator_options = {"mixed_precision": "no", **(accelerator_options or {})}
    if accelerator_options["mixed_precision"] == "fp8":  # Accelerate's torchao recipe, weights gathered in FP8
        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig
        accelerator_options["kwargs_handlers"] = [AORecipeKwargs(
            config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))]
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=ACCUM), **accelerator_options)
    # On CPU Accelerate makes the job MULTI_CPU and ignores the plugin: made FSDP as in
    # accelerate_loop_workers (prepare and the loop then run the FSDP2 code unchanged).
    if acc.distributed_type != DistributedType.FSDP:
        acc.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        if acc.mixed_precision != "no":  # what AcceleratorState gives an FSDP job's plugin
            plugin.set_mixed_precision(acc.mixed_precision)
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
        ours_options = {k: BUCKET_BYTES if v is None else v for k, v in ours_options.items()}
        torch_fsdp.fully_shard = (functools.partial(mfsdp.fully_shard, **ours_options) if system == "ours"
                                  else FSDP2_FULLY_SHARD)
        self.system, self.rank = system, dist.get_rank()
        self.acc = _accelerator(plugin_options, parallelism, ACCELERATOR_OPTIONS.get(name))
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
            "param_dtype": str(getattr(s.options.mp_policy, "param_dtype", None)),
            "reduce_dtype": str(getattr(s.options.mp_policy, "reduce_dtype", None)),
            "offloaded": bool(u.offloaded),
            "mesh": None if s.device_mesh is None else [list(s.device_mesh.mesh_dim_names),
                                                         list(s.device_mesh.mesh.shape)],
            "shard_group_size": dist.get_world_size(s.process_group),
            "slots": s.slots_hold.value,
            "unsharded_bytes": int(u.unsharded_storage_bytes),
            # torchao's FP8 all-gather: the parameters gathered as FP8 bytes
            "gathers_bytes": bool(u.gathers_bytes),
            "fp8_weights": fp8_gathered_names(u),
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
    backward and after an optimizer step; the local shard sizes of the parameters; ours'
    buckets; the c10d reduce-scatter calls of the probe's backward; the weight type each
    torchao Float8Linear layer's forward sees (Float8TrainingTensor: gathered in FP8)."""
    from megatron_fsdp_ext import _C
    facts = _unit_facts if run.system == "ours" else _fsdp2_facts
    ids = train_data()[:BATCH]
    out = {"before": facts(run.model)}
    if run.system == "ours":
        # The root's bucket budgets and the units (labels) of each gather and reduce bucket.
        out["buckets"] = schedule_buckets(run.model, {id(s): s.label for s in iter_states(run.model)})
        before = _C.collective_counts()["reduce_scatter"][0]
    float8 = [m for m in run.model.modules() if type(m).__name__ == "Float8Linear"]
    out["float8_forward_weights"] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: out["float8_forward_weights"].append(
        type(mod.weight).__name__)) for m in float8]
    loss = run.model(input_ids=ids, labels=ids).loss
    for h in hooks:
        h.remove()
    out["float8_linears"] = len(float8)
    out["after_forward"] = facts(run.model)
    loss.backward()
    if run.system == "ours":
        out["reduce_scatter_calls"] = _C.collective_counts()["reduce_scatter"][0] - before
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
            # Every rank's loss (acc.gather) and their mean (acc.reduce), as scripts log them.
            rec["gathered"].append(_np(acc.gather(loss.detach()[None])).tolist())
            rec["reduced"].append(acc.reduce(loss.detach().clone(), reduction="mean").item())
            if acc.sync_gradients:
                # Names as the model's own (a compiled model's lose "_orig_mod.").
                grads = {n.replace("_orig_mod.", ""): _np(_full(p.grad)) for n, p in model.named_parameters()}
                norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM).item()
                rec["steps"].append({"grad_pre": grads, "norm": norm} if run.rank == 0 else {"norm": norm})
            run.opt.step()
            run.sched.step()
            run.opt.zero_grad()
    params = run.full_params()
    if run.rank == 0:
        rec["params"] = {n.replace("_orig_mod.", ""): v for n, v in params.items()}


def _save_pretrained(run: FeatureRun, rec: dict) -> None:
    """Accelerate's documented save: unwrap_model(model).save_pretrained(dir,
    state_dict=accelerator.get_state_dict(model), is_main_process=..., save_function=
    accelerator.save); rank 0 reads the safetensors back."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import load_file
    acc = run.acc
    box = [tempfile.mkdtemp(prefix="acc_save_pretrained_") if run.rank == 0 else None]
    dist.broadcast_object_list(box)
    sd = acc.get_state_dict(run.model)
    acc.unwrap_model(run.model).save_pretrained(box[0], state_dict=sd, is_main_process=acc.is_main_process,
                                                save_function=acc.save)
    acc.wait_for_everyone()
    if run.rank == 0:
        files = [f for f in sorted(os.listdir(box[0])) if f.endswith(".safetensors")]
        rec["save_pretrained"] = {k: _np(v) for f in files for k, v in load_file(os.path.join(box[0], f)).items()}
        shutil.rmtree(box[0])


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
            rec = {"losses": [], "steps": [], "gathered": [], "reduced": []}
            if system == "ours" and name == "zero1":  # the default plugin: refused by name
                try:
                    FeatureRun(system, name, plugin_override={"reshard_after_forward": True})
                except ValueError as e:
                    rec["default_plugin_error"] = str(e)
                finally:
                    torch_fsdp.fully_shard = FSDP2_FULLY_SHARD
                    _reset_accelerate()
            torch._dynamo.reset()
            counters.clear()
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
                rec["graphs"] = counters["stats"]["unique_graphs"]
                if name in SAVE_PRETRAINED:
                    _save_pretrained(run, rec)
                rec["probe"] = _probe(run)
            finally:
                run.close()
            out[(name, system)] = rec
    return out
