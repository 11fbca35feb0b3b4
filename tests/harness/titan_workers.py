"""torchtitan's own parallelize code running unchanged on our fully_shard: its Llama3
"debugmodel" built from its model registry, sharded by its `apply_fsdp_to_decoder` (and
tensor-parallelized by `parallelize_llama` with its ParallelDims mesh) where the one
change is the `fully_shard` those functions call: ours instead of torch's. Trained against
one plain process on the whole batch (fp32: losses, gradients, parameters).

Then torchtitan's training loop itself (Trainer.train_step, its loss normalization by the
global token count, its clip_grad_norm_, optimizer and LR-schedule containers, its
CheckpointManager) on FSDP2 and on ours side by side: see "torchtitan's training loop" below.

torchtitan 0.3.0 imports triton only for one MoE kernel module; `install_triton_stub`
replaces that module (the dense Llama3 path never calls it); `install_trainer_stubs` does
the same for what torchtitan.trainer imports of torchdata, datasets and tensorboard. On CPU its flex attention has
no backward, so the debugmodel's inner attention is swapped for causal SDPA, in the
reference model too.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import time
import types
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .observe import counting_aot_eager, schedule_buckets
from .tp_workers import full_of_ours, placements_of, plain_name
from .workers import device_for_backend, rel_err, shard_piece

_TRITON_KERNELS = [
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
]
VOCAB, SEQ = 2048, 32


def install_triton_stub() -> None:
    """torchtitan.distributed.minimal_async_ep.kernels without triton: kernels that raise."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    for kernel in _TRITON_KERNELS:
        def missing(*args, _kernel=kernel, **kwargs):
            raise RuntimeError(f"{_kernel}: a triton kernel, stubbed out (triton is not installed)")
        setattr(mod, kernel, missing)
    sys.modules[name] = mod


# What torchtitan.trainer imports for the parts of its job these tests do not build (its
# HF datasets dataloader, TensorBoard logging), where .ci/run does not install them.
_TRAINER_ONLY_IMPORTS = ["torch.utils.tensorboard", "torchdata", "torchdata.stateful_dataloader", "datasets",
                         "datasets.distributed"]


def _stub_module(name: str) -> None:
    """A module whose every attribute is an empty class (created on first use): enough
    for `from X import Y` and class definitions deriving from Y; using Y does nothing."""
    mod = types.ModuleType(name)
    mod.__path__ = []

    def __getattr__(attr, _name=name):
        if attr.startswith("__"):
            raise AttributeError(attr)
        cls = type(attr, (), {"__module__": _name, "__init__": _stubbed_init})
        setattr(sys.modules[_name], attr, cls)
        return cls

    mod.__getattr__ = __getattr__
    sys.modules[name] = mod


def _stubbed_init(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__module__}.{type(self).__name__}: stubbed out (not installed)")


def install_trainer_stubs() -> None:
    """torchtitan.trainer importable without torchdata, datasets and tensorboard: each
    one that does not import is replaced by a stub module (train_step uses none of them)."""
    import importlib

    install_triton_stub()
    for name in _TRAINER_ONLY_IMPORTS:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules.pop(name, None)
            _stub_module(name)


def available() -> str:
    """'' when torchtitan imports here, else why not."""
    try:
        install_triton_stub()
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: report it)
        return f"{type(e).__name__}: {e}"
    return ""


def _debugmodel_config(parallelism=None):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if parallelism is not None:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    return cfg


def _debugmodel(parallelism=None):
    cfg = _debugmodel_config(parallelism)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model.to(device_for_backend())


def _ours_in_torchtitan():
    """Point the `fully_shard` torchtitan's fsdp module calls at ours; returns the module."""
    import torchtitan.distributed.fsdp as tt_fsdp

    tt_fsdp.fully_shard = mfsdp.fully_shard
    return tt_fsdp


def _batches(steps: int, per: int, dp_world: int):
    g = torch.Generator().manual_seed(1000)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (dp_world * per, SEQ + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _loss(model, tokens, labels):
    logits = model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train_against_plain(model, ref, placements: Dict, tp_mesh, dp_index: int, dp_world: int, steps: int = 3) -> Dict:
    device = device_for_backend()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    per, worst = 2, {"loss": 0.0, "grad": 0.0}
    for step, (tokens, labels) in enumerate(_batches(steps, per, dp_world)):
        rows = slice(dp_index * per, (dp_index + 1) * per)
        loss = _loss(model, tokens[rows].to(device), labels[rows].to(device))
        # torchtitan sets every unit's gradient divide factor to 1.0 (its trainer divides
        # the loss by the global token count instead): reduced gradients are sums over the
        # data-parallel ranks, so each rank's mean loss is scaled by 1 / dp_world here.
        (loss / dp_world).backward()
        ref_loss = _loss(ref, tokens.to(device), labels.to(device))
        ref_loss.backward()
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss.item())
        mean = sum(losses) / len(losses)  # equal rows per dp rank; tp ranks repeat theirs
        err = abs(mean - ref_loss.item()) / abs(ref_loss.item())
        assert err <= 1e-5, f"step {step}: loss {mean} vs one process {ref_loss.item()}"
        worst["loss"] = max(worst["loss"], err)
        ours = full_of_ours(model, "grad", placements, tp_mesh)
        for name, p in ref.named_parameters():
            e = rel_err(ours[name].reshape(p.shape), p.grad)
            assert e <= 1e-4, f"step {step}: gradient of '{name}' rel err {e:.3e}"
            worst["grad"] = max(worst["grad"], e)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    values = full_of_ours(model, "value", placements, tp_mesh)
    worst["param"] = max(rel_err(values[n].reshape(p.shape), p.detach()) for n, p in ref.named_parameters())
    assert worst["param"] <= 1e-4, f"parameters after {steps} steps: rel err {worst['param']}"
    return worst


def titan_apply_fsdp(rank: int, world: int) -> Dict:
    """torchtitan's apply_fsdp_to_decoder on a 1-D ("dp_shard",) mesh, ours swapped in: it
    shards every block, [norm, lm_head] as one unit (FSDP2's list form) and the root."""
    from torch.distributed.device_mesh import init_device_mesh

    install_triton_stub()
    tt_fsdp = _ours_in_torchtitan()
    ref = _debugmodel()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh(device_for_backend().type, (world,), mesh_dim_names=("dp_shard",))
    tt_fsdp.apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  pp_enabled=False)
    assert isinstance(model, mfsdp.FSDPModule) and isinstance(model.layers["0"], mfsdp.FSDPModule)
    assert isinstance(model.lm_head, mfsdp.FSDPModule) and model.lm_head._fsdp_state is model.norm._fsdp_state, \
        "torchtitan's [norm, lm_head] is not one unit"
    placements = placements_of(model)
    return _train_against_plain(model, ref, placements, None, rank, world)


def titan_parallelize_llama(rank: int, world: int, tp: int) -> Dict:
    """torchtitan's parallelize_llama with tensor parallelism (its partial_dtensor backend:
    DTensors on the "tp" axis of its ParallelDims mesh, sequence parallel on) and FSDP on
    the "fsdp" axis, ours swapped in."""
    install_triton_stub()
    _ours_in_torchtitan()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    # torchtitan falls back to "cuda" when it finds no accelerator; its mesh follows this.
    tt_parallel_dims.device_type = device_for_backend().type
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=tp,
                                    data_parallel_shard_degree=world // tp)
    ref = _debugmodel(parallelism)
    model = _debugmodel(parallelism)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                      parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                      dump_folder="/tmp")
    assert isinstance(model, mfsdp.FSDPModule)
    states = [s for s in iter_states(model) if s.unit is not None]
    assert any(s.tp is not None for s in states), "no unit holds tensor-parallel parameters"
    # The TP placements, from the same model parallelized by torchtitan without FSDP.
    probe = _debugmodel(parallelism)
    probe.parallelize(dims)
    placements = placements_of(probe)
    assert any(isinstance(p, DTensor) for p in probe.parameters())
    tp_mesh, fsdp_mesh = dims.get_mesh("tp"), dims.get_mesh("fsdp")
    dp_index = fsdp_mesh.get_local_rank()
    return _train_against_plain(model, ref, placements, tp_mesh, dp_index, world // tp)


def titan_tp_from_meta(rank: int, world: int, tp: int) -> Dict:
    """torchtitan's Trainer.__init__ way with tensor parallelism, ours swapped in: the
    debugmodel built on meta, parallelize_llama (TP and FSDP), to_empty, then init_states
    under no_grad. Every value equals torchtitan's TP model alone built the same way from
    the same seed (its own `parallelize`, no FSDP); loaded then with one process's values,
    it trains as that process does."""
    install_triton_stub()
    _ours_in_torchtitan()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    device = device_for_backend()
    tt_parallel_dims.device_type = device.type
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=tp,
                                    data_parallel_shard_degree=world // tp)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    cfg = _debugmodel_config(parallelism)
    built = {}
    for which in ("alone", "ours"):
        with torch.device("meta"):
            model = cfg.build()
        if which == "alone":
            model.parallelize(dims)
            placements = placements_of(model)
        else:
            parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                              parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                              dump_folder="/tmp")
        model.to_empty(device=device)
        torch.manual_seed(7)
        with torch.no_grad():
            model.init_states(buffer_device=device)
        built[which] = model
    model = built["ours"]
    assert any(s.tp is not None for s in iter_states(model) if s.unit is not None), "no tensor-parallel unit"
    tp_mesh, fsdp_mesh = dims.get_mesh("tp"), dims.get_mesh("fsdp")
    got = full_of_ours(model, "value", placements, tp_mesh)
    for name, p in built["alone"].named_parameters():
        want = (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().cpu()
        assert torch.equal(got[name].reshape(want.shape), want), \
            f"'{name}' after to_empty + init_states differs from the TP model's alone"
    # torch's helper, as torchtitan loads a full checkpoint: its fused-qkv hooks merge the
    # file's wq/wk/wv into wqkv on the way in.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = _debugmodel(parallelism)
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    return _train_against_plain(model, ref, placements, tp_mesh, fsdp_mesh.get_local_rank(), world // tp)


# ------------------------------------------------------------------ torchtitan's training loop
#
# Below, torchtitan's own Trainer.train_step runs unchanged (gradient accumulation, its
# global-token loss normalization, its clip_grad_norm_, its optimizer and LR scheduler
# containers, its checkpointer) on two copies of its Llama3 debugmodel job: one
# parallelized by torchtitan with torch's fully_shard (FSDP2), one with ours swapped in, as
# a user swaps it (torchtitan.distributed.fsdp.fully_shard). The Trainer object is built
# by hand (Trainer.__new__ plus the attributes train_step reads, made by the same
# components Trainer.__init__ builds): its __init__ also wants a tokenizer, a dataset,
# torchrun's environment and an accelerator. Everything train_step computes is torchtitan's.

class _StepLog:
    """torchtitan's MetricsProcessor as train_step uses it (should_log, log): logs every
    step and keeps what train_step reports: the global average loss, the max over ranks of
    their local average losses, the grad norm its clip_grad_norm_ returned, the lr."""

    def __init__(self):
        self.rows = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        lr = {k: v for k, v in (extra_metrics or {}).items() if k.startswith("lr")}
        self.rows.append({"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                          "grad_norm": float(grad_norm), "lr": lr})


class _StepData:
    """A dataloader for train_step: batch (step, micro) is a function of its indices (so a
    resumed run sees the same data), each rank takes its rows of the global batch; labels
    end in a run of IGNORE_INDEX of random length, so ranks hold different numbers of
    valid tokens and the loss normalization by the GLOBAL count matters. Stateful for
    torchtitan's checkpointer (its "dataloader" entry)."""

    def __init__(self, local_bs: int, accum: int, batch_degree: int, batch_rank: int):
        self.local_bs, self.accum = local_bs, accum
        self.batch_degree, self.batch_rank = batch_degree, batch_rank
        self.step = 0  # the next step whose batches __iter__ yields

    def batch(self, step: int, micro: int):
        from torchtitan.components.loss import IGNORE_INDEX

        g = torch.Generator().manual_seed(7919 * step + 104729 * micro + 1)
        rows = self.batch_degree * self.local_bs
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        keep = torch.randint(SEQ // 4, SEQ + 1, (rows,), generator=g)
        labels[torch.arange(SEQ)[None, :] >= keep[:, None]] = IGNORE_INDEX
        mine = slice(self.batch_rank * self.local_bs, (self.batch_rank + 1) * self.local_bs)
        return {"input": tokens[mine, :-1]}, labels[mine]

    def __iter__(self):
        while True:
            step = self.step
            for micro in range(self.accum):
                if micro == self.accum - 1:
                    self.step = step + 1  # consumed once train_step took the step's last micro-batch
                yield self.batch(step, micro)

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


@contextlib.contextmanager
def _fully_shard_in_torchtitan(impl: str, unpinned_offload: bool = False):
    """torchtitan's fsdp module calling `impl`'s fully_shard: "ours" (the swap a user
    makes) or "fsdp2" (torch's, torchtitan's own). unpinned_offload: the CPUOffloadPolicy()
    torchtitan passes under training.enable_cpu_offload becomes CPUOffloadPolicy(
    pin_memory=False) (FSDP2's pin_memory() needs an accelerator: on a CPU-only machine
    it raises "Cannot access accelerator device when none is available")."""
    import functools

    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    saved, saved_policy = tt_fsdp.fully_shard, tt_fsdp.CPUOffloadPolicy
    tt_fsdp.fully_shard = mfsdp.fully_shard if impl == "ours" else torch_fully_shard
    if unpinned_offload:
        tt_fsdp.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=False)
    try:
        yield
    finally:
        tt_fsdp.fully_shard, tt_fsdp.CPUOffloadPolicy = saved, saved_policy


def _debugmodel_spec(fuse_qkv: bool):
    """torchtitan's model_registry("debugmodel"); fuse_qkv=False: the same model with
    separate q and kv projections (QKVLinear) instead of its fused wqkv."""
    import torchtitan.models.llama3 as tt_llama3

    if fuse_qkv:
        return tt_llama3.model_registry("debugmodel")
    build = tt_llama3._build_llama3_layers
    tt_llama3._build_llama3_layers = lambda **kw: build(**dict(kw, fuse_qkv=False))
    try:
        return tt_llama3.model_registry("debugmodel")
    finally:
        tt_llama3._build_llama3_layers = build


def _job_config(parallelism, *, steps: int, max_norm: float, local_bs: int, accum: int, batch_degree: int,
                loss: str = "chunked", ac: bool = True, fuse_qkv: bool = True, dump_folder: str = "/tmp",
                model: str = "llama3", training: Optional[Dict] = None, compile: Optional[Dict] = None,
                float8: Optional[Dict] = None):
    """torchtitan's llama3 debugmodel job (config_registry.llama3_debugmodel: its model,
    loss, optimizer, LR schedule, activation checkpointing), shrunk for CPU: SDPA instead of
    flex attention, SEQ-token sequences, fp32, `steps` steps, the given parallelism.
    loss: "chunked" (the job's ChunkedLossWrapper of CrossEntropyLoss) or "ce"
    (CrossEntropyLoss on the whole output: the same normalization).
    model: "llama3", or "dsv3" for the DeepSeek-V3 debugmodel job (config_registry.
    deepseek_v3_debugmodel: 8 routed experts top-3 with auxiliary-loss-free load balancing,
    whose model spec registers the expert-bias hook on the optimizers).
    Job-level options, each through torchtitan's own config (None: the job's default):
    training: more TrainingConfig fields (e.g. enable_cpu_offload=True); compile:
    CompileConfig fields (e.g. enable=True, components=["model"], backend="aot_eager");
    float8: Float8LinearConverter.Config fields (e.g. emulate=True), the converter built
    into the model spec as config_registry.llama3_debugmodel_float8 does; and
    "enable_fsdp_float8_all_gather": True, which torchtitan 0.3.0's converter has no field
    for: the torchao Float8LinearConfig it put in every converted layer's config
    (Float8Linear.Config._torchao_config) gets that flag, torchao's FP8 all-gather, and
    _built_model wraps those weights as torchao's from_float does."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel() if model == "llama3" else _moe_job(model)
    if not fuse_qkv:
        cfg.model_spec = _debugmodel_spec(fuse_qkv=False)
    if compile is not None:
        cfg.compile = CompileConfig(**compile)
    if float8 is not None:
        assert model == "llama3" and fuse_qkv, "float8: the llama3 debugmodel as it is"
        import torchtitan.models.llama3 as tt_llama3
        from torchtitan.components.quantization import Float8Linear, Float8LinearConverter
        from torchtitan.models.common.linear import Linear

        float8 = dict(float8)
        fp8_gather = float8.pop("enable_fsdp_float8_all_gather", False)
        model_compile_enabled = cfg.compile.enable and "model" in cfg.compile.components
        cfg.model_spec = tt_llama3.model_registry("debugmodel", converters=[
            Float8LinearConverter.Config(**dict(dict(model_compile_enabled=model_compile_enabled), **float8))])
        converted = [c for _, c, _, _ in cfg.model_spec.model.traverse(Linear.Config)
                     if isinstance(c, Float8Linear.Config)]
        assert converted, "the Float8 converter converted no Linear"
        if fp8_gather:
            import dataclasses

            for c in converted:
                c._torchao_config = dataclasses.replace(c._torchao_config, enable_fsdp_float8_all_gather=True)
    for layer in cfg.model_spec.model.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if loss == "ce":
        cfg.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    if not ac:
        cfg.activation_checkpoint = None
    cfg.training = TrainingConfig(local_batch_size=local_bs, global_batch_size=local_bs * batch_degree * accum,
                                  seq_len=SEQ, steps=steps, max_norm=max_norm, mixed_precision_param="float32",
                                  disable_cuda_graphs=True, **(training or {}))
    cfg.parallelism = parallelism
    cfg.dump_folder = dump_folder
    return cfg


def _moe_job(model: str):
    assert model == "dsv3", f"MoE job {model!r}: only 'dsv3' (DeepSeek-V3 debugmodel) here"
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return deepseek_v3_debugmodel()


def _parallel_dims(parallelism, world: int):
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.distributed import ParallelDims

    # torchtitan falls back to "cuda" when it finds no accelerator; its mesh follows this.
    tt_parallel_dims.device_type = device_for_backend().type
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    return dims


def _built_model(cfg):
    """The debugmodel built whole with torchtitan's init, seeded: the same weights on
    every rank and in every build (parallelize_fn then shards these real tensors)."""
    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    torch.manual_seed(0)
    model = model_config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    model = model.to(device_for_backend())
    _wrap_for_float8_all_gather(model)
    return model


def _wrap_for_float8_all_gather(model) -> int:
    """torchao's convert_to_float8_training (Float8Linear.from_float) wraps the weight of
    a layer whose config has enable_fsdp_float8_all_gather in WeightWithDynamicFloat8CastTensor,
    which is what makes FSDP2 gather it in FP8; torchtitan 0.3.0 builds its Float8Linear
    by __init__, which does not (the flag alone changes nothing). Done here as from_float
    does it; returns the number of weights wrapped (0 without torchao Float8Linear layers)."""
    if "torchao.float8.float8_linear" not in sys.modules:  # no Float8Linear can exist
        return 0
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    wrapped = 0
    for m in model.modules():
        if (isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather
                and not isinstance(m.weight, WeightWithDynamicFloat8CastTensor)):
            m.weight = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(
                m.weight, m.linear_mm_config, m.config.cast_config_weight.target_dtype),
                requires_grad=m.weight.requires_grad)
            wrapped += 1
    return wrapped


def _titan_trainer(cfg, dims, impl: str, checkpoint=None, from_meta: bool = False, unpinned_offload: bool = False):
    """A torchtitan Trainer for train_step, built as Trainer.__init__ builds its non-PP
    components: the model (built whole: _built_model), its parallelize_fn with `impl`'s
    fully_shard, its loss, optimizer and LR scheduler containers, and its checkpointer
    (`checkpoint`: a CheckpointManager.Config; default disabled). from_meta: the model
    built on meta as Trainer.__init__ builds it, parallelized, then `to_empty` and
    `init_states` under no_grad; then _built_model's values loaded through torch's
    state-dict helper, so that both systems start from the same weights.
    unpinned_offload: see _fully_shard_in_torchtitan."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.config, t.parallel_dims, t.device = cfg, dims, device_for_backend()
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)  # as Trainer.__init__ does
    spec = cfg.model_spec
    whole = _built_model(cfg)
    if from_meta:
        with torch.device("meta"):
            model = spec.model.build()
    else:
        model = whole
    t.model_config = spec.model
    with _fully_shard_in_torchtitan(impl, unpinned_offload):
        model = spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
                                    compile_config=cfg.compile, ac_config=cfg.activation_checkpoint,
                                    dump_folder=cfg.dump_folder)
    if from_meta:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=t.device)
        with torch.no_grad():
            model.init_states(buffer_device=t.device)
        if impl == "ours":  # a fresh run trains on these values: no unit may wait for a load
            from megatron_fsdp_ext.core.param_index import check_materialized

            check_materialized(list(iter_states(model)), "after to_empty and init_states")
        set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
    model.train()
    if impl == "fsdp2" and dist.get_backend() == "gloo":
        # torchtitan's divide factor 1.0 makes FSDP2 reduce with PREMUL_SUM(1.0), which Gloo
        # refuses; FSDP2's own SUM-then-scale (factor 1.0: nothing) gives the same sums.
        for m in _fsdp_modules(model).values():
            m.set_force_sum_reduction_for_comms(True)
    t.model_parts = [model]
    t.loss_fn = cfg.loss.build(compile_config=cfg.compile)
    if isinstance(t.loss_fn, ChunkedLossWrapper):
        t.loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    batch_mesh = dims.get_mesh("batch")
    batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    t.gradient_accumulation_steps = cfg.training.global_batch_size // (cfg.training.local_batch_size * batch_degree)
    t.num_pipeline_parallel_microbatches = 1
    t.optimizers = cfg.optimizer.build(model_parts=t.model_parts)
    if spec.post_optimizer_build_fn is not None:  # MoE models: the expert-bias load-balancing hook
        spec.post_optimizer_build_fn(t.optimizers, t.model_parts, dims)
    t.lr_schedulers = cfg.lr_scheduler.build(optimizers=t.optimizers, training_steps=cfg.training.steps)
    t.metrics_processor = _StepLog()
    t.step, t.ntokens_seen = 0, 0
    t.dataloader = _StepData(cfg.training.local_batch_size, t.gradient_accumulation_steps, batch_degree, batch_rank)
    t.checkpointer = (checkpoint or CheckpointManager.Config()).build(
        dataloader=t.dataloader, model_parts=t.model_parts, optimizers=t.optimizers,
        lr_schedulers=t.lr_schedulers, states={"train_state": t}, sd_adapter=None, base_folder=cfg.dump_folder)
    t.train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    t.fwd_bwd_fn = t._forward_backward_body
    return t


def _train(t, steps: int) -> list:
    """torchtitan's Trainer.train loop body for `steps` steps: step += 1, train_step,
    checkpointer.save. Returns the logged rows of these steps."""
    data = iter(t.dataloader)
    first = len(t.metrics_processor.rows)
    for _ in range(steps):
        t.step += 1
        t.train_step(data)
        t.checkpointer.save(t.step, last_step=(t.step == t.config.training.steps))
    return t.metrics_processor.rows[first:]


def _fsdp_modules(model) -> Dict[str, object]:
    """{name: module} of the modules torch's isinstance check (torchtitan's
    disable_fsdp_gradient_division) takes for FSDP2's."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return {plain_name(n): m for n, m in model.named_modules() if isinstance(m, TorchFSDPModule)}


def check_titan_reached_ours(ours_model, fsdp2_model) -> int:
    """Every module our fully_shard sharded is a torch FSDPModule (the same modules as
    under FSDP2), and torchtitan's disable_fsdp_gradient_division set every unit's divide
    factor to 1.0 (torchtitan normalizes by the global token count itself). Returns the
    number of units checked."""
    sharded = {plain_name(n): m for n, m in ours_model.named_modules() if "_mfsdp_state" in m.__dict__}
    assert sharded, "our fully_shard sharded nothing"
    seen = _fsdp_modules(ours_model)
    missing = sorted(set(sharded) - set(seen))
    assert not missing, f"modules sharded by our fully_shard that are not torch FSDPModules: {missing}"
    expected = sorted(_fsdp_modules(fsdp2_model))
    assert sorted(seen) == expected, f"FSDP modules: ours {sorted(seen)} vs FSDP2 {expected}"
    units = 0
    for name, m in sharded.items():
        unit = m._fsdp_state.unit
        if unit is None:
            continue
        units += 1
        assert unit.gradient_divide_factor == 1.0, \
            f"'{name}': gradient divide factor {unit.gradient_divide_factor}, torchtitan set 1.0"
    for name, m in _fsdp_modules(fsdp2_model).items():  # what torchtitan did to FSDP2's
        for group in m._get_fsdp_state()._fsdp_param_groups:
            assert group.gradient_divide_factor == 1.0, f"FSDP2 '{name}': divide factor {group.gradient_divide_factor}"
    return units


def _full_params(model, impl: str, tp_mesh=None, tp_placements=None) -> Dict[str, torch.Tensor]:
    if impl == "fsdp2":
        return {plain_name(n): p.full_tensor().detach().double().cpu() for n, p in model.named_parameters()}
    return full_of_ours(model, "value", tp_placements, tp_mesh)


def _tp_placements_of_fsdp2(model, tp: bool) -> Dict[str, tuple]:
    """Each parameter's placement on the "tp" axis, read off FSDP2's DTensors."""
    from torch.distributed.tensor import Replicate

    out = {}
    for n, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names or ()
        out[plain_name(n)] = (p.placements[names.index("tp")],) if tp and "tp" in names else (Replicate(),)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _setup(world: int, parallelism: Dict, **job):
    """torchtitan's ParallelDims (partial_dtensor backend: DTensors on the tp axis only;
    our fully_shard does not take FSDP2's dp_mesh_dims of the spmd_types / full_dtensor
    backends) and its debugmodel job."""
    install_trainer_stubs()
    from torchtitan.config import ParallelismConfig

    pcfg = ParallelismConfig(spmd_backend="partial_dtensor", **parallelism)
    dims = _parallel_dims(pcfg, world)
    batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    return dims, _job_config(pcfg, batch_degree=batch_degree, **job)


def _compare_rows(got: Dict, ref: Dict, step, tol: float, worst: Dict, what: str = "ours vs FSDP2") -> None:
    for key in ("loss", "max_loss", "grad_norm"):
        e = _rel(got[key], ref[key])
        worst[key] = max(worst.get(key, 0.0), e)
        assert e <= tol, f"step {step}: {key} {what}: {got[key]!r} vs {ref[key]!r} (rel {e:.2e})"
    assert got["lr"] == ref["lr"], f"step {step}: lr {got['lr']} vs {ref['lr']} ({what})"


def _compare_params(ours, fsdp2, dims, tol: float, when: str) -> float:
    """Every parameter of ours (rebuilt from the ranks' pieces) against FSDP2's
    (full_tensor), at most `tol` relative; returns the largest difference."""
    tp = dims.tp_enabled
    placements = _tp_placements_of_fsdp2(fsdp2.model_parts[0], tp)
    mine = _full_params(ours.model_parts[0], "ours", dims.get_mesh("tp") if tp else None, placements)
    theirs = _full_params(fsdp2.model_parts[0], "fsdp2")
    assert sorted(mine) == sorted(theirs), f"parameter names: ours {sorted(mine)} vs FSDP2 {sorted(theirs)}"
    errs = {n: rel_err(mine[n].reshape(theirs[n].shape), theirs[n]) for n in theirs}
    name = max(errs, key=errs.get)
    assert errs[name] <= tol, f"parameters {when}: '{name}' ours vs FSDP2 rel err {errs[name]:.2e}"
    return errs[name]


def _train_vs_fsdp2(world: int, parallelism: Dict, *, steps: int, max_norm: float, loss: str, ac: bool,
                    local_bs: int, accum: int, tol: float, job: Optional[Dict] = None, probe=None,
                    unpinned_offload: bool = False) -> Dict:
    """job: more _job_config options (training, compile, float8). probe(ours, fsdp2, dims),
    called once both Trainers are built, returns a function of no arguments called after
    the training, whose dict is the result's "reached" (what shows that the option reached
    our units; it asserts). unpinned_offload: FSDP2's (see _fully_shard_in_torchtitan)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    dims, cfg = _setup(world, parallelism, steps=steps, max_norm=max_norm, local_bs=local_bs, accum=accum,
                       loss=loss, ac=ac, **(job or {}))
    init = {plain_name(n): p.detach().double().cpu() for n, p in _built_model(cfg).named_parameters()}
    fsdp2 = _titan_trainer(cfg, dims, "fsdp2", unpinned_offload=unpinned_offload)
    ours = _titan_trainer(cfg, dims, "ours")
    units = check_titan_reached_ours(ours.model_parts[0], fsdp2.model_parts[0])
    finish = probe(ours, fsdp2, dims) if probe is not None else None
    curves = {"fsdp2": [], "ours": []}
    worst: Dict[str, float] = {}
    for step in range(1, steps + 1):
        ref, got = _train(fsdp2, 1)[0], _train(ours, 1)[0]
        curves["fsdp2"].append(ref)
        curves["ours"].append(got)
        _compare_rows(got, ref, step, tol, worst)
    clipped = sum(r["grad_norm"] > max_norm for r in curves["fsdp2"])
    assert clipped == steps, f"clipping active on {clipped} of {steps} steps only (max_norm {max_norm})"
    worst["param"] = _compare_params(ours, fsdp2, dims, tol, f"after {steps} steps")
    theirs = _full_params(fsdp2.model_parts[0], "fsdp2")
    moved = max(rel_err(theirs[n], init[n]) for n in theirs)  # training did change the weights
    assert moved > 1e-3, f"parameters moved by {moved:.2e} only"
    out = {"worst": worst, "curves": curves, "units": units, "moved": moved,
           "buckets": bucket_plan(ours.model_parts[0]),  # "auto" resolved, unless a probe set them
           "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}
    if finish is not None:
        out["reached"] = finish()
    return out


def titan_train_vs_fsdp2(rank: int, world: int, parallelism: Dict, steps: int = 20, max_norm: float = 0.25,
                         loss: str = "ce", ac: bool = True, local_bs: int = 2, accum: int = 2,
                         tol: float = 1e-5) -> Dict:
    """torchtitan's train_step on its debugmodel job, parallelized by torchtitan with
    FSDP2 and with ours (the fully_shard swap), step by step on the same ranks: the global
    loss, the max over ranks of the local loss, the grad norm its clip_grad_norm_ returns
    (clipping active: max_norm below every step's norm) and, at the end, every parameter,
    within `tol` relative. Also checks (check_titan_reached_ours) that torchtitan's
    disable_fsdp_gradient_division reached our units."""
    return _train_vs_fsdp2(world, parallelism, steps=steps, max_norm=max_norm, loss=loss, ac=ac,
                           local_bs=local_bs, accum=accum, tol=tol)


def titan_train_matrix(rank: int, world: int, configs: Dict[str, Dict], **common) -> Dict[str, Dict]:
    """titan_train_vs_fsdp2 for several parallelisms of the same world in one launch
    (torchtitan imports once): {name: its result, or {"error": traceback}}. A config that
    failed the same way on every rank (a comparison of global values) lets the next one
    run; otherwise the ranks may no longer agree on the collectives, and the rest is
    reported as not run."""
    return _run_matrix(world, list(configs), lambda name: _train_vs_fsdp2(world, configs[name], **common))


def _run_matrix(world: int, names, run) -> Dict[str, Dict]:
    """run(name) for each name (titan_train_matrix's loop and its error handling)."""
    import traceback

    out: Dict[str, Dict] = {}
    for i, name in enumerate(names):
        try:
            out[name] = run(name)
            last = None
        except Exception as e:  # noqa: BLE001 (reported per config)
            out[name] = {"error": traceback.format_exc()}
            last = f"{type(e).__name__}: {e}"
        every = [None] * world
        dist.all_gather_object(every, last)
        if any(every) and len(set(every)) > 1:
            out[name].setdefault("error", f"failed on ranks {[r for r, m in enumerate(every) if m]}")
            for rest in names[i + 1:]:
                out[rest] = {"error": f"not run: '{name}' failed differently across ranks"}
            break
    return out


def _local_grad_norm(model) -> float:
    """The 2-norm of this rank's gradient pieces as plain tensors: what torch's clip
    computed on our sharded gradients before they reduced across ranks (grad_norm.py)."""
    grads = [p.grad.detach().as_subclass(torch.Tensor).double() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _plain_step(cfg, step: int, batch_degree: int):
    """One process, the whole model, the whole global batch of `step`: torchtitan's loss
    (sum over tokens / the global count of valid tokens, accumulated over the
    micro-batches) and torch's get_total_norm of the gradients. Returns (model, loss, norm)."""
    from torchtitan.components.loss import IGNORE_INDEX

    model = _built_model(cfg)
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    local_bs = cfg.training.local_batch_size
    accum = cfg.training.global_batch_size // (local_bs * batch_degree)
    data = _StepData(local_bs * batch_degree, accum, 1, 0)  # rank 0 of 1: every row
    micro = [data.batch(step, m) for m in range(accum)]
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro)
    total = 0.0
    for inputs, labels in micro:
        loss, _ = loss_fn(model(inputs["input"]), labels, torch.tensor(tokens))
        loss.backward()
        total += loss.item()
    # In float64: torch's fp32 norm of a whole 2048x256 gradient on the CPU is off by
    # ~5e-5 relative (the sharded runs' norms of half-size pieces by ~3e-5).
    norm = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()])
    return model, total, float(norm)


def titan_guard(rank: int, world: int, max_norm: float = 0.25) -> Dict:
    """What makes ours a drop-in under torchtitan's training loop, on its own:
    - every module our fully_shard sharded is a torch FSDPModule (the same modules as
      FSDP2's) and torchtitan's disable_fsdp_gradient_division set every unit's gradient
      divide factor to 1.0;
    - the grad norm torchtitan's clip_grad_norm_ returns (torch's get_total_norm on our
      sharded gradients) is the GLOBAL norm: equal to FSDP2's and to one plain process'
      on the whole batch, and far from this rank's local norm;
    - the clipped gradients are the plain process' gradients times the clip coefficient."""
    dims, cfg = _setup(world, {"data_parallel_shard_degree": world}, steps=1, max_norm=max_norm, local_bs=2,
                       accum=2, loss="ce", ac=False)
    fsdp2 = _titan_trainer(cfg, dims, "fsdp2")
    ours = _titan_trainer(cfg, dims, "ours")
    units = check_titan_reached_ours(ours.model_parts[0], fsdp2.model_parts[0])
    plain, plain_loss, plain_norm = _plain_step(cfg, 0, dims.get_mesh("batch").size())
    # train_step leaves the clipped gradients in .grad (the next step's zero_grad clears them).
    ref, got = _train(fsdp2, 1)[0], _train(ours, 1)[0]
    worst: Dict[str, float] = {}
    _compare_rows(got, ref, 1, 1e-5, worst)
    e_plain = _rel(got["grad_norm"], plain_norm)  # fp32 norms on the CPU: see _plain_step
    assert e_plain <= 1e-4, f"grad norm ours {got['grad_norm']!r} vs one process {plain_norm!r} (rel {e_plain:.2e})"
    e_loss = _rel(got["loss"], plain_loss)
    assert e_loss <= 1e-5, f"loss ours {got['loss']!r} vs one process {plain_loss!r} (rel {e_loss:.2e})"
    coef = min(1.0, max_norm / (got["grad_norm"] + 1e-6))  # torch's clip_grads_with_norm_
    assert coef < 1.0, f"no clipping at grad norm {got['grad_norm']} (max_norm {max_norm})"
    local = _local_grad_norm(ours.model_parts[0]) / coef
    gap = _rel(local, got["grad_norm"])
    assert gap > 0.05, f"this rank's local norm {local} is the global one {got['grad_norm']}: nothing was checked"
    grads = full_of_ours(ours.model_parts[0], "grad", placements_of(plain))
    e_grad = max(rel_err(grads[n].reshape(p.shape), p.grad * coef) for n, p in plain.named_parameters())
    assert e_grad <= 1e-5, f"clipped gradients ours vs one process: rel err {e_grad:.2e}"
    return {"units": units, "norm": got["grad_norm"], "fsdp2_norm": ref["grad_norm"], "plain_norm": plain_norm,
            "local_norm": local, "worst": dict(worst, plain_norm=e_plain, plain_loss=e_loss, grad=e_grad)}


def titan_checkpoint_interchange(rank: int, world: int, parallelism: Dict, folder: str, save_at: int = 2,
                                 then: int = 2, max_norm: float = 0.25, tol: float = 1e-5,
                                 fuse_qkv: bool = True) -> Dict:
    """torchtitan's CheckpointManager (DCP; model, optimizer, LR scheduler, dataloader and
    train state) between FSDP2 and ours: both train `save_at` steps and save, then
    continue `then` steps (the reference continuations); a fresh ours resumes from FSDP2's
    checkpoint and a fresh FSDP2 from ours, and each continues exactly as the run that
    saved it did (losses, grad norms, lr, and the parameters at the end)."""
    import os

    from torchtitan.components.checkpoint import CheckpointManager

    cpu0 = time.process_time()
    steps = save_at + then
    dims, cfg = _setup(world, parallelism, steps=steps, max_norm=max_norm, local_bs=2, accum=2, loss="ce",
                       ac=False, fuse_qkv=fuse_qkv)
    where = {impl: os.path.join(folder, impl) for impl in ("fsdp2", "ours")}

    def saving(impl):
        return CheckpointManager.Config(enable=True, folder=where[impl], interval=save_at, keep_latest_k=0,
                                        last_save_model_only=False)

    def loading(impl):
        return CheckpointManager.Config(enable=True, folder=where[impl], load_only=True, keep_latest_k=0)

    runs = {impl: _titan_trainer(cfg, dims, impl, checkpoint=saving(impl)) for impl in ("fsdp2", "ours")}
    worst: Dict[str, float] = {}
    rows = {"fsdp2": [], "ours": []}
    for step in range(1, steps + 1):
        for impl in ("fsdp2", "ours"):
            rows[impl] += _train(runs[impl], 1)
        _compare_rows(rows["ours"][-1], rows["fsdp2"][-1], step, tol, worst)
    for impl in ("fsdp2", "ours"):
        assert os.path.isdir(os.path.join(where[impl], f"step-{save_at}")), f"{impl} saved no step-{save_at}"
    # Each implementation resumes from the other's checkpoint.
    resumed = {}
    for impl, other in (("ours", "fsdp2"), ("fsdp2", "ours")):
        t = _titan_trainer(cfg, dims, impl, checkpoint=loading(other))
        assert t.checkpointer.load(step=save_at), f"{impl}: nothing loaded from {other}'s checkpoint"
        assert t.step == save_at and t.dataloader.step == save_at, \
            f"{impl} resumed at step {t.step} (data at {t.dataloader.step}), not {save_at}"
        got = _train(t, then)
        for g, ref in zip(got, rows[other][save_at:]):
            _compare_rows(g, ref, g["step"], tol, worst, f"{impl} resumed from {other}'s checkpoint vs {other}")
        resumed[impl] = {"rows": got, "trainer": t}
    worst["param_ours_from_fsdp2"] = _compare_params(resumed["ours"]["trainer"], runs["fsdp2"], dims, tol,
                                                     "of ours resumed from FSDP2's checkpoint")
    worst["param_fsdp2_from_ours"] = _compare_params(runs["ours"], resumed["fsdp2"]["trainer"], dims, tol,
                                                     "of FSDP2 resumed from our checkpoint")
    return {"worst": worst, "rows": rows, "resumed": {k: v["rows"] for k, v in resumed.items()},
            "cpu_s": time.process_time() - cpu0}


# ------------------------------------------------------------------ torchtitan's pipeline parallel
#
# torchtitan's PP path as Trainer.__init__ takes it when pipeline_parallel_degree > 1: its
# model_spec.pipelining_fn (pipeline_llm: its stage split by _pipeline_module_split into
# torch PipelineStages, its parallelize_llama on each stage's model part, here with
# `impl`'s fully_shard, and _build_pipeline_schedule), then Trainer.train_step unchanged:
# pp_forward_backward_step driving the schedule (which calls each stage's FSDPModule
# hooks: set_requires_gradient_sync, set_is_last_backward, set_reshard_after_backward and
# its post_backward on the state's _fsdp_param_groups), the loss normalized by the global
# token count, clip_grad_norm_ with pp_mesh (the norm all-reduced over the stages), its
# optimizers and LR scheduler over model_parts.

def _microbatch_step_shim(schedule) -> bool:
    """torchtitan 0.3.0's pp_forward_backward_step calls
    `pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...,
    return_outputs=False)`: already split micro-batches, a step API this torch's schedules
    lack (their step(*args, target=, losses=, return_outputs=, loss_kwargs=, **kwargs) splits
    a whole batch and would take arg_mbs & co. for model kwargs: "ValueError: Expecting 2
    arg_mbs but got 1"). Routes such a call to the schedule's own _step_microbatches, after
    the per-step stage setup its step does (has_backward, clear_runtime_states); the same
    for FSDP2 and ours. Returns whether the shim was needed."""
    import inspect

    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return False
    whole_batch_step = schedule.step

    def step(*args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
             loss_kwargs=None, **kwargs):
        if args or kwargs or (arg_mbs is None and kwarg_mbs is None and target_mbs is None):
            return whole_batch_step(*args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                                    **kwargs)
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                    loss_kwargs=loss_kwargs)
        return None

    schedule.step = step
    return True


def _titan_pp_trainer(cfg, dims, impl: str):
    """A torchtitan Trainer for train_step with pipeline parallelism, built as
    Trainer.__init__ builds it (its PP branch). Not done here: Trainer.__init__'s
    to_empty + init_weights of each part (it builds on the meta device); the parts keep
    the seeded weights of _built_model, the same under both systems."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.config, t.parallel_dims, t.device = cfg, dims, device_for_backend()
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    spec = cfg.model_spec
    model = _built_model(cfg)
    t.model_config = spec.model
    t.loss_fn = cfg.loss.build(compile_config=cfg.compile)
    with _fully_shard_in_torchtitan(impl):
        t.pp_schedule, t.model_parts, t.pp_has_first_stage, t.pp_has_last_stage = spec.pipelining_fn(
            model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
            compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder,
            device=t.device, model_config=spec.model, parallelize_fn=spec.parallelize_fn, loss_fn=t.loss_fn)
    del model
    t.pp_step_shimmed = _microbatch_step_shim(t.pp_schedule)
    for m in t.model_parts:
        m.train()
        if impl == "fsdp2" and dist.get_backend() == "gloo":  # as in _titan_trainer
            for fm in _fsdp_modules(m).values():
                fm.set_force_sum_reduction_for_comms(True)
    batch_mesh = dims.get_mesh("batch")
    batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    micro = cfg.parallelism.pipeline_parallel_microbatch_size
    t.gradient_accumulation_steps = cfg.training.global_batch_size // (cfg.training.local_batch_size * batch_degree)
    t.num_pipeline_parallel_microbatches = cfg.training.local_batch_size // micro
    t.optimizers = cfg.optimizer.build(model_parts=t.model_parts)
    if spec.post_optimizer_build_fn is not None:  # MoE models: the expert-bias load-balancing hook
        spec.post_optimizer_build_fn(t.optimizers, t.model_parts, dims)
    t.lr_schedulers = cfg.lr_scheduler.build(optimizers=t.optimizers, training_steps=cfg.training.steps)
    t.metrics_processor = _StepLog()
    t.step, t.ntokens_seen = 0, 0
    # Trainer.__init__'s dataloader under PP yields micro-batches (pipeline_parallel_microbatch_size
    # rows); train_step takes num_pipeline_parallel_microbatches of them per accumulation step.
    t.dataloader = _StepData(micro, t.gradient_accumulation_steps * t.num_pipeline_parallel_microbatches,
                             batch_degree, batch_rank)
    t.checkpointer = CheckpointManager.Config().build(
        dataloader=t.dataloader, model_parts=t.model_parts, optimizers=t.optimizers,
        lr_schedulers=t.lr_schedulers, states={"train_state": t}, sd_adapter=None, base_folder=cfg.dump_folder)
    t.train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    return t


def _local_params(t, impl: str) -> Dict[str, torch.Tensor]:
    """{name: this rank's piece of the flattened parameter} for the parts this rank holds,
    as (offset, values): ours' 1-D shard pieces at their offsets; FSDP2's full_tensor
    (collective over the stage's dp group) flattened whole, offset 0."""
    out = {}
    for i, m in enumerate(t.model_parts):
        for n, p in m.named_parameters():
            if impl == "fsdp2":
                out[plain_name(n)] = (0, p.full_tensor().detach().reshape(-1).double().cpu())
            else:
                piece = shard_piece(p)[2]
                out[plain_name(n)] = (piece.param_offset, p.detach().reshape(-1).double().cpu())
    return out


def titan_pp_vs_fsdp2(rank: int, world: int, pp: int = 2, schedule: str = "1F1B", steps: int = 3,
                      max_norm: float = 0.25, loss: str = "ce", ac: bool = False, local_bs: int = 2,
                      accum: int = 1, tol: float = 1e-5) -> Dict:
    """torchtitan's pipeline parallel (pipeline_llm, `schedule`, pp stages) x FSDP
    (dp_shard = world // pp) on its debugmodel job, FSDP2 and ours (the fully_shard swap)
    side by side, through its Trainer.train_step: per step the global loss and max local
    loss (as logged on the last stage's ranks), the grad norm of clip_grad_norm_ with
    pp_mesh (clipping active), and at the end every parameter, within `tol` relative."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    parallelism = {"pipeline_parallel_degree": pp, "data_parallel_shard_degree": world // pp,
                   "pipeline_parallel_schedule": schedule, "pipeline_parallel_microbatch_size": 1}
    dims, cfg = _setup(world, parallelism, steps=steps, max_norm=max_norm, local_bs=local_bs, accum=accum,
                       loss=loss, ac=ac)
    pp_mesh = dims.get_mesh("pp")
    pp_rank = pp_mesh.get_local_rank()
    init = {plain_name(n): p.detach().double().cpu() for n, p in _built_model(cfg).named_parameters()}
    runs = {impl: _titan_pp_trainer(cfg, dims, impl) for impl in ("fsdp2", "ours")}
    for impl, t in runs.items():
        stages = getattr(t.pp_schedule, "_stages", None) or [t.pp_schedule._stage]
        assert all(s.submod is m for s, m in zip(stages, t.model_parts)), f"{impl}: stage modules are not the parts"
    units = sum(check_titan_reached_ours(o, f) for o, f in zip(runs["ours"].model_parts, runs["fsdp2"].model_parts))
    names = sorted(plain_name(n) for m in runs["ours"].model_parts for n, _ in m.named_parameters())
    rows = {impl: [] for impl in runs}
    for _ in range(steps):
        for impl in ("fsdp2", "ours"):
            rows[impl] += _train(runs[impl], 1)
    # Every rank's rows; train_step's loss is meaningful on the last stage's ranks only
    # (the others log the placeholder -1 its pp_forward_backward_step returns there).
    every = [None] * world
    dist.all_gather_object(every, (pp_rank, rows, names))
    last = [r for p, r, _ in every if p == pp - 1]
    worst: Dict[str, float] = {}
    for other in last[1:]:
        for impl in runs:
            for a, b in zip(other[impl], last[0][impl]):
                _compare_rows(a, b, a["step"], 0.0, {}, f"{impl}: last-stage ranks disagree")
    for p, r, _ in every:  # the norm clip_grad_norm_ returns is global over pp: every rank's
        for impl in runs:
            for a, b in zip(r[impl], last[0][impl]):
                e = _rel(a["grad_norm"], b["grad_norm"])
                assert e <= 1e-6, f"{impl}: pp rank {p} grad norm {a['grad_norm']} vs last stage {b['grad_norm']}"
    got_rows, ref_rows = last[0]["ours"], last[0]["fsdp2"]
    for got, ref in zip(got_rows, ref_rows):
        _compare_rows(got, ref, got["step"], tol, worst)
    clipped = sum(r["grad_norm"] > max_norm for r in ref_rows)
    assert clipped == steps, f"clipping active on {clipped} of {steps} steps only (max_norm {max_norm})"
    assert all(2.0 < r["loss"] < 20.0 for r in ref_rows), f"implausible losses {[r['loss'] for r in ref_rows]}"
    # Parameters: each rank's piece of ours against the same range of FSDP2's full tensor.
    mine, theirs = _local_params(runs["ours"], "ours"), _local_params(runs["fsdp2"], "fsdp2")
    assert sorted(mine) == sorted(theirs), f"parameter names: ours {sorted(mine)} vs FSDP2 {sorted(theirs)}"
    param_err, moved = 0.0, 0.0
    for n, (offset, piece) in mine.items():
        ref = theirs[n][1][offset: offset + piece.numel()]
        param_err = max(param_err, rel_err(piece, ref) if piece.numel() else 0.0)
        moved = max(moved, rel_err(theirs[n][1], init[n].reshape(-1)))
    errs = [None] * world
    dist.all_gather_object(errs, (param_err, moved))
    worst["param"] = max(e for e, _ in errs)
    moved = min(m for _, m in errs)
    assert worst["param"] <= tol, f"parameters after {steps} steps: ours vs FSDP2 rel err {worst['param']:.2e}"
    assert moved > 1e-3, f"parameters moved by {moved:.2e} only"
    covered = sorted({n for _, _, ns in every for n in ns})
    assert covered == sorted(init), f"stages hold {covered}, the model {sorted(init)}"
    return {"worst": worst, "curves": {"fsdp2": ref_rows, "ours": got_rows}, "units": units,
            "schedule": type(runs["ours"].pp_schedule).__name__, "step_shim": runs["ours"].pp_step_shimmed,
            "stage_names": {p: ns for p, _, ns in every}, "moved": moved,
            "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}


def titan_to_empty_init_weights(rank: int, world: int) -> Dict:
    """torchtitan's Trainer.__init__ way from the meta device, ours swapped in: the
    debugmodel built on meta, sharded by apply_fsdp_to_decoder, then `to_empty(device)`
    and its own `init_weights(buffer_device=...)` under no_grad, as the Trainer calls them.
    Every parameter and buffer equals the same model built on the device and initialized
    by init_weights with the same seed in one plain process (bit for bit), the RNG is
    where that process's is, and training then matches it."""
    from torch.distributed.device_mesh import init_device_mesh

    install_triton_stub()
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    tt_fsdp = _ours_in_torchtitan()
    device = device_for_backend()
    cfg = model_registry("debugmodel").model
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device(device):
        ref = cfg.build()
    torch.manual_seed(7)
    with torch.no_grad():
        ref.init_weights(buffer_device=device)
    ref_rng = torch.get_rng_state()
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    tt_fsdp.apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  pp_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(7)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    assert torch.equal(torch.get_rng_state(), ref_rng), "init_weights drew another amount of random numbers"
    want = ref.state_dict()
    for key, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        assert torch.equal(full, want[key]), f"'{key}' after to_empty + init_weights differs from one process's"
    return _train_against_plain(model, ref, placements_of(model), None, rank, world)


# ------------------------------------------------------------------ torchtitan's own options
#
# torchtitan 0.3.0 options that reach fully_shard, each set through its own job config and
# run through Trainer.train_step on FSDP2 and on ours (_train_vs_fsdp2), with a probe
# showing the option reached our units (and FSDP2's the same way):
# - parallelism.fsdp_reshard_after_forward "never" / "always": apply_fsdp_to_decoder's
#   reshard_after_forward per unit ("never": False everywhere, FSDP2's ZeRO-2; "always":
#   True everywhere, [norm, lm_head] included; "default", the other tests': True but for
#   [norm, lm_head]);
# - data_parallel_replicate_degree = world, data_parallel_shard_degree 1: its pure data
#   parallelism, HSDP with shard groups of one rank (nothing sharded);
# - training.enable_cpu_offload: offload_policy=CPUOffloadPolicy() on every unit;
# - Float8LinearConverter (emulate=True: the CPU has no FP8 matmul): torchao Float8Linear
#   layers built into the model config, gathered in the parameter dtype; torchtitan 0.3.0
#   has no FP8 all-gather option, so "float8_gather" sets torchao's
#   enable_fsdp_float8_all_gather in the converted layers' torchao config (_job_config)
#   and wraps their weights as torchao's from_float does (_wrap_for_float8_all_gather);
# - compile.enable with components ["model", "loss"]: apply_compile's
#   block.compile(fullgraph=True) on every block before fully_shard, and the loss compiled.

def _units_of(model, impl: str) -> Dict[str, object]:
    """{module name: our FSDPState (ours) or FSDP2's param group} of every FSDP module
    that holds parameters (a unit of several modules appears under each)."""
    out = {}
    for name, m in _fsdp_modules(model).items():
        unit = m._fsdp_state if impl == "ours" else m._get_fsdp_state()._fsdp_param_group
        if unit is not None and (impl != "ours" or unit.unit is not None):
            out[name] = unit
    return out


def _is_gathered(unit, impl: str) -> bool:
    return unit.unit.unsharded_storage_bytes > 0 if impl == "ours" else unit.is_unsharded


def _reshards_after_forward(unit, impl: str) -> bool:
    """The unit's effective reshard-after-forward (after lazy init: the root never does)."""
    return unit.reshard_after_forward if impl == "ours" else unit.post_forward_mesh_info is not None


def _reshard_probe(policy: str):
    """fsdp_reshard_after_forward=`policy`: every unit's reshard-after-forward is what
    torchtitan's get_fsdp_reshard_after_forward_policy says, the same under ours as under
    FSDP2; and what it does: when norm's forward ends (every block and the embedding ran
    forward, backward not begun), under "never" every block and the embedding are still
    gathered, under "always" none is, in both; after each step all are sharded again."""
    want = {"never": False, "always": True}[policy]

    def probe(ours, fsdp2, dims):
        models = {"ours": ours.model_parts[0], "fsdp2": fsdp2.model_parts[0]}
        seen = {impl: [] for impl in models}

        def record(impl):
            units = _units_of(models[impl], impl)
            seen[impl].append({n: _is_gathered(u, impl) for n, u in units.items()})

        hooks = [models[impl].norm.register_forward_hook(lambda *_, impl=impl: record(impl)) for impl in models]

        def finish():
            for h in hooks:
                h.remove()
            n_forwards = len(seen["fsdp2"])
            assert n_forwards > 0 and len(seen["ours"]) == n_forwards, \
                f"norm's forward ran {len(seen['ours'])} times under ours, {n_forwards} under FSDP2"
            assert seen["ours"] == seen["fsdp2"], \
                f"gathered after forward: ours {seen['ours'][0]} vs FSDP2 {seen['fsdp2'][0]}"
            early = [n for n in seen["ours"][0] if n == "tok_embeddings" or n.startswith("layers.")]
            assert len(early) >= 7, early
            for i, row in enumerate(seen["ours"]):
                wrong = [n for n in early if row[n] != (not want)]
                assert not wrong, f"forward {i}: {'gathered' if want else 'sharded'} after forward: {wrong}"
            config = {}
            for impl in models:
                units = _units_of(models[impl], impl)
                config[impl] = {n: _reshards_after_forward(u, impl) for n, u in units.items()}
                still = [n for n, u in units.items() if _is_gathered(u, impl)]
                assert not still, f"{impl}: gathered after the step: {still}"
            assert config["ours"] == config["fsdp2"], \
                f"reshard_after_forward: ours {config['ours']} vs FSDP2 {config['fsdp2']}"
            assert set(config["ours"].values()) == {want}, f"reshard_after_forward under {policy!r}: {config['ours']}"
            return {"reshard_after_forward": config["ours"], "gathered_after_forward": seen["ours"][0],
                    "forwards": n_forwards}
        return finish
    return probe


def _offload_probe(ours, fsdp2, dims):
    """training.enable_cpu_offload: every unit of ours is offloaded (its shard and, after
    backward, its gradient in host buffers; pinned only with an accelerator), as every
    parameter of FSDP2 is (offload_to_cpu)."""
    units = _units_of(ours.model_parts[0], "ours")
    assert units and all(st.unit.offloaded for st in units.values()), \
        f"not offloaded: {[n for n, st in units.items() if not st.unit.offloaded]}"
    theirs = _units_of(fsdp2.model_parts[0], "fsdp2")
    assert theirs and all(p.offload_to_cpu for g in theirs.values() for p in g.fsdp_params)
    assert sorted(units) == sorted(theirs)

    def finish():
        host = {n: st.unit.host_nbytes for n, st in units.items()}
        small = [n for n, st in units.items() if host[n] < 2 * st.unit.sharded_flat.nbytes]
        assert not small, f"no host gradient buffer next to the host shard: {small}"
        return {"offloaded": sorted(units), "pinned": any(st.unit.pinned for st in units.values()),
                "host_bytes": sum(host.values())}
    return finish


def _float8_probe(gather: bool):
    """The Float8 converter: the same Float8Linear layers under ours as under FSDP2 (every
    Linear of the blocks and lm_head); each computes on a Float8TrainingTensor weight in
    forward under both when `gather` (torchao's FP8 all-gather: FSDP2's
    WeightWithDynamicFloat8CastTensor shards, our units' FP8 gather of every such weight)
    and on the plain gathered weight otherwise (no FP8 gather in either)."""
    def probe(ours, fsdp2, dims):
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        models = {"ours": ours.model_parts[0], "fsdp2": fsdp2.model_parts[0]}
        fp8 = {impl: {plain_name(n): m for n, m in models[impl].named_modules() if isinstance(m, Float8Linear)}
               for impl in models}
        assert len(fp8["ours"]) >= 6 * 3 + 1 and sorted(fp8["ours"]) == sorted(fp8["fsdp2"]), \
            f"Float8Linear layers: ours {sorted(fp8['ours'])} vs FSDP2 {sorted(fp8['fsdp2'])}"
        assert all(m.config.enable_fsdp_float8_all_gather == gather for m in fp8["ours"].values())
        shards = {type(m.weight._local_tensor) for m in fp8["fsdp2"].values()}
        assert shards == ({WeightWithDynamicFloat8CastTensor} if gather else {torch.Tensor}), shards
        # Our units: the FP8 gather transform on exactly the Float8Linear weights.
        names = {id(p): plain_name(n) for n, p in models["ours"].named_parameters()}
        fp8_specs = 0
        for st in {id(s): s for s in _units_of(models["ours"], "ours").values()}.values():
            for spec, param in zip(st.unit.param_specs, st.unit.sharded_params):
                is_fp8 = "FP8" in str(spec.transform)
                name = names[id(param)]
                fp8_weight = name.endswith(".weight") and name[:-len(".weight")] in fp8["ours"]
                assert is_fp8 == (gather and fp8_weight), f"'{name}': gather transform {spec.transform}"
                fp8_specs += is_fp8
        assert fp8_specs == (len(fp8["ours"]) if gather else 0), f"{fp8_specs} weights gathered in FP8"
        seen = {impl: set() for impl in models}
        hooks = [m.register_forward_pre_hook(lambda mod, args, impl=impl: seen[impl].add(type(mod.weight)))
                 for impl in models for m in fp8[impl].values()]

        def finish():
            for h in hooks:
                h.remove()
            want = Float8TrainingTensor if gather else torch.nn.Parameter
            for impl in models:
                assert seen[impl] and all(issubclass(t, want) for t in seen[impl]), \
                    f"{impl}: Float8Linear weights in forward were {seen[impl]}, not {want.__name__}"
            return {"float8_linears": len(fp8["ours"]), "fp8_gathered_weights": fp8_specs,
                    "forward_weight_types": sorted(t.__name__ for t in seen["ours"])}
        return finish
    return probe


def _replicate_probe(ours, fsdp2, dims):
    """data_parallel_replicate_degree = world, data_parallel_shard_degree 1: torchtitan's
    pure data parallelism, HSDP on a (world, 1) mesh: every unit of ours has shard groups
    of one rank (whole parameters on every rank, no gather) and reduces over `world`
    replicas, as every group of FSDP2 does."""
    world = dist.get_world_size()
    units = {id(s): s for s in _units_of(ours.model_parts[0], "ours").values()}.values()
    sizes = {(st.unit.world_size, st.unit.replicate_size) for st in units}
    assert sizes == {(1, world)}, f"our units' (shard, replicate) group sizes: {sizes}"
    theirs = {(g.mesh_info.shard_mesh_size, g.mesh_info.replicate_mesh_size)
              for g in _units_of(fsdp2.model_parts[0], "fsdp2").values()}
    assert theirs == {(1, world)}, f"FSDP2's (shard, replicate) mesh sizes: {theirs}"
    whole = all(st.unit.sharded_flat.numel() >= sum(p.numel() for p in st.unit.unsharded_params) for st in units)
    assert whole, "a unit holds less than its whole parameters"
    return lambda: {"shard_replicate_sizes": sorted(sizes), "units": len(units)}


def bucket_plan(model) -> Dict:
    """Our root's bucket_budgets() (gather, reduce; "auto" resolved: what the first
    backward's link measurement chose) and the gather and reduce buckets its schedule cut
    from the recorded forward order, each unit by its path (a unit of several modules by
    its first member's)."""
    states = {}
    for name, m in model.named_modules():
        st = m.__dict__.get("_mfsdp_state")
        if st is not None and st.unit is not None:
            states.setdefault(id(st), plain_name(name) or "root")
    ctx = model._fsdp_state.ctx
    if ctx is None:  # never ran forward
        return {"budgets": tuple(model.bucket_budgets())}
    return dict(schedule_buckets(model, states),
                sizes=[st.unit.unsharded_nbytes for st in ctx.schedule.forward_order])


def _bucket_probe(ours, fsdp2, dims):
    """Explicit buckets as a torchtitan user sets them (its config has no such field): on
    the root parallelize_llama returned, set_gather_bucket_bytes / set_reduce_bucket_bytes
    of twice a block's gathered bytes, before the first step (the root's setters; the
    buckets follow the order its first step records). FSDP2 runs unchanged. Then: the
    root's bucket_budgets() are those; its schedule cut the forward order [tok_embeddings,
    6 blocks, [norm, lm_head]] into buckets of two or more units for gathers and for
    reductions; every backward reduce-scatters once per reduce bucket, except the first
    (its micro-batch records the order: one per unit)."""
    from megatron_fsdp_ext import _C

    model = ours.model_parts[0]
    units = {id(st): st for st in _units_of(model, "ours").values()}.values()
    block = max(st.unit.unsharded_nbytes for name, st in _units_of(model, "ours").items() if name.startswith("layers."))
    budget = 2 * block
    model.set_gather_bucket_bytes(budget)
    model.set_reduce_bucket_bytes(budget)
    counts = []

    def step(*args, _step=ours.train_step, **kwargs):
        _C.reset_collective_counts()
        out = _step(*args, **kwargs)
        c = _C.collective_counts()
        counts.append({"all_gather": c["all_gather"][0], "reduce_scatter": c["reduce_scatter"][0]})
        return out
    ours.train_step = step

    def finish():
        plan = bucket_plan(model)
        assert plan["budgets"] == (budget, budget), f"bucket_budgets() {plan['budgets']}, set {budget}"
        assert len(plan["order"]) == len(units) >= 8, plan["order"]
        for kind in ("gather", "reduce"):
            assert [n for b in plan[kind] for n in b] == plan["order"], f"{kind} buckets {plan[kind]}"
            assert 1 < len(plan[kind]) < len(units) and max(len(b) for b in plan[kind]) >= 2, plan[kind]
        accum = ours.gradient_accumulation_steps
        # the first micro-batch's backward records the order (one reduce-scatter per unit);
        # every later backward reduces by buckets
        assert counts[0]["reduce_scatter"] == len(units) + (accum - 1) * len(plan["reduce"]), (counts, plan["reduce"])
        for c in counts[1:]:
            assert c["reduce_scatter"] == accum * len(plan["reduce"]), (counts, plan["reduce"])
        return {"budget": budget, "plan": plan, "counts": counts}
    return finish


COUNTING_BACKEND = "mfsdp_titan_counting_aot_eager"
_COMPILED = {"graphs": {}, "calls": {}, "current": None}


def _register_counting_backend() -> None:
    """COUNTING_BACKEND, a torch.compile backend name for torchtitan's compile.backend:
    aot_eager, counting the graphs it compiles and the calls of their compiled code, per
    Trainer ("current", set around its train_step by _compile_probe)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if COUNTING_BACKEND not in _COMPILER_FNS:
        register_backend(counting_aot_eager(_COMPILED), name=COUNTING_BACKEND)


def _compile_probe(ours, fsdp2, dims):
    """compile.enable, components ["model", "loss"]: torchtitan compiled every block
    (block.compile(fullgraph=True) before fully_shard: our unit hooks then run inside the
    compiled module call, outside the graph) and the loss; every block's forward and the
    loss of every micro-batch run compiled code under ours, as many calls as under FSDP2."""
    torch._dynamo.reset()
    _COMPILED["graphs"].clear()
    _COMPILED["calls"].clear()
    models = {"ours": ours.model_parts[0], "fsdp2": fsdp2.model_parts[0]}
    blocks = {impl: list(models[impl].layers.values()) for impl in models}
    for impl in models:
        assert all(b._compiled_call_impl is not None for b in blocks[impl]), f"{impl}: a block is not compiled"
    for impl, t in (("ours", ours), ("fsdp2", fsdp2)):
        def step(*args, _step=t.train_step, _impl=impl, **kwargs):
            _COMPILED["current"] = _impl
            try:
                return _step(*args, **kwargs)
            finally:
                _COMPILED["current"] = None
        t.train_step = step
    steps = {"ours": 0, "fsdp2": 0}
    for impl, t in (("ours", ours), ("fsdp2", fsdp2)):
        t.metrics_processor.log = _counting(t.metrics_processor.log, steps, impl)

    def finish():
        calls = dict(_COMPILED["calls"])
        micro = ours.gradient_accumulation_steps * steps["ours"]
        want = micro * (len(blocks["ours"]) + 1)  # every block's forward and the loss, per micro-batch
        assert calls.get("ours", 0) == calls.get("fsdp2", 0) == want, \
            f"compiled calls: {calls}, want {want} ({micro} micro-batches x {len(blocks['ours'])} blocks + loss)"
        assert sum(_COMPILED["graphs"].values()) >= 2, _COMPILED["graphs"]
        return {"compiled_calls": calls, "graphs": dict(_COMPILED["graphs"])}
    return finish


def _counting(log, steps: Dict[str, int], impl: str):
    def counted(*args, **kwargs):
        steps[impl] += 1
        return log(*args, **kwargs)
    return counted


TITAN_OPTIONS = {
    # name: (ParallelismConfig fields, "world": the launch's world size; _job_config options)
    "reshard_never": ({"fsdp_reshard_after_forward": "never"}, {}),
    "reshard_always": ({"fsdp_reshard_after_forward": "always"}, {}),
    "replicate_only": ({"data_parallel_replicate_degree": "world", "data_parallel_shard_degree": 1}, {}),
    "cpu_offload": ({}, {"training": {"enable_cpu_offload": True}}),
    "float8": ({}, {"float8": {"emulate": True}}),
    "float8_gather": ({}, {"float8": {"emulate": True, "enable_fsdp_float8_all_gather": True}}),
    "compile": ({}, {"compile": {"enable": True, "components": ["model", "loss"], "backend": COUNTING_BACKEND}}),
    "buckets": ({}, {}),  # set on ours' root after parallelize_llama (_bucket_probe)
}


def _option_probe(name: str):
    return {"reshard_never": _reshard_probe("never"), "reshard_always": _reshard_probe("always"),
            "replicate_only": _replicate_probe,
            "cpu_offload": _offload_probe, "float8": _float8_probe(False), "float8_gather": _float8_probe(True),
            "compile": _compile_probe, "buckets": _bucket_probe}[name]


def titan_options_matrix(rank: int, world: int, names, steps: int = 3, max_norm: float = 0.25, loss: str = "ce",
                         ac: bool = True, local_bs: int = 2, accum: int = 2, tol: float = 1e-5) -> Dict[str, Dict]:
    """For each of TITAN_OPTIONS' `names`, in one launch: torchtitan's train_step on its
    debugmodel job with that option set in its config (FSDP over all ranks), FSDP2 and
    ours step by step (_train_vs_fsdp2: loss, max local loss, grad norm with clipping
    active, every parameter at the end), and the option's probe. FSDP2 offloads unpinned
    (its pin_memory() needs an accelerator; ours pins only with one)."""
    _register_counting_backend()

    def run(name):
        parallelism, job = TITAN_OPTIONS[name]
        parallelism = {k: world if v == "world" else v for k, v in parallelism.items()}
        job = dict(job)
        return _train_vs_fsdp2(world, dict({"data_parallel_shard_degree": world}, **parallelism), steps=steps,
                               max_norm=max_norm, loss=job.pop("loss", loss), ac=ac, local_bs=local_bs, accum=accum,
                               tol=tol, job=job, probe=_option_probe(name),
                               unpinned_offload=bool(job.get("training", {}).get("enable_cpu_offload")))
    return _run_matrix(world, list(names), run)
