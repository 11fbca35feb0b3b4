"""Workers of tests/distributed/test_convert_and_assign.py: what Hugging Face Accelerate's
FSDP2 path does to a sharded model, in torch's own calls, against FSDP2 doing the same:
a dtype change after fully_shard (its upcast of a low-precision model), state_dict() of a
model sharded on the meta device and load_state_dict(assign=True) of DTensors built from
its placements (its cpu_ram_efficient_loading)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import megatron_fsdp_ext as mfsdp

from .workers import device_for_backend, expect_error, torchrun_environment


def _mlp(device, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(),
                         nn.Linear(16, 4)).to(device=device, dtype=dtype)


def _shard(model, system, mesh, **kwargs):
    shard = mfsdp.fully_shard if system == "ours" else fsdp2_shard
    for m in (model[0], model[2], model):
        shard(m, mesh=mesh, **kwargs)
    return model


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, optimizer, steps: int, device, dtype):
    """`steps` AdamW steps on this rank's batches: per step the loss, every full gradient
    and every full parameter after the step (fp32 copies)."""
    rank = dist.get_rank()
    out = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank)).to(device, dtype)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        grads = [_full(p.grad).detach().float().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.detach().float().clone(), grads,
                    [_full(v).detach().float().clone() for v in model.state_dict().values()]))
    return out


def _assert_same(ours, theirs, what: str, tol: float) -> None:
    for step, ((lo, go, po), (lt, gt, pt)) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(lo, lt, rtol=tol, atol=tol, msg=lambda m: f"{what}, step {step}, loss: {m}")
        for k, (a, b) in enumerate(zip(go, gt)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}, step {step}, grad {k}: {m}")
        for k, (a, b) in enumerate(zip(po, pt)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}, step {step}, param {k}: {m}")


def _swapping(convert):
    """`convert` with torch's swap_tensors conversion (torch.__future__) turned on."""
    def run(m):
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return convert(m)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    return run


# (how the model is built, its mixed-precision policy, the conversion after fully_shard)
CONVERSIONS = {
    # Accelerate with mixed precision on a bf16 model: fp32 master weights, bf16 compute.
    "bf16_model_upcast": (torch.bfloat16, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                               reduce_dtype=torch.float32),
                          lambda m: m.to(torch.float32)),
    # Pure low-precision training: an fp32 model cast down after sharding.
    "fp32_model_half": (torch.float32, MixedPrecisionPolicy(), lambda m: m.bfloat16()),
    "fp32_model_double": (torch.float32, MixedPrecisionPolicy(), lambda m: m.double()),
    "fp32_model_double_swapped": (torch.float32, MixedPrecisionPolicy(), _swapping(lambda m: m.double())),
}


def dtype_change_after_fully_shard(rank: int, world: int, case: str) -> float:
    """`case`'s conversion after fully_shard, the optimizer built before it (FSDP2's
    parameters keep their identity across it, and so do ours): three steps equal FSDP2's,
    losses, full gradients and parameters; the parameters take the new dtype. Returns the
    largest loss difference."""
    device = device_for_backend()
    mesh = init_device_mesh(device.type, (world,))
    build_dtype, policy, convert = CONVERSIONS[case]
    runs = {}
    for system in ("ours", "fsdp2"):
        model = _shard(_mlp(device, build_dtype), system, mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        params_before = list(model.parameters())
        out = convert(model)
        assert out is model
        want = convert(torch.empty(0)).dtype
        assert all(p.dtype == want for p in model.parameters()), (system, [p.dtype for p in model.parameters()])
        assert all(a is b for a, b in zip(params_before, model.parameters())), f"{system}: parameters replaced"
        compute = policy.param_dtype or want
        runs[system] = _train(model, optimizer, 3, device, compute)
    tol = 1e-5 if case != "fp32_model_half" else 1e-2
    _assert_same(runs["ours"], runs["fsdp2"], case, tol)
    return max(abs(a[0] - b[0]).item() for a, b in zip(runs["ours"], runs["fsdp2"]))


def dtype_changes_refused(rank: int, world: int) -> None:
    """What a unit cannot take is refused by name, before anything changes: a dtype
    change after the first forward, a device change, and a module inside a unit cast
    on its own (the unit keeps one dtype)."""
    device = device_for_backend()
    mesh = init_device_mesh(device.type, (world,))
    model = _shard(_mlp(device), "ours", mesh)
    expect_error(lambda: model[4].double(), RuntimeError, "cannot change its sharded parameters", "torch.float64")
    expect_error(lambda: model.to("meta"), RuntimeError, "cannot change its sharded parameters", "its device")
    model(torch.ones(2, 16, device=device)).sum().backward()
    expect_error(lambda: model.double(), RuntimeError, "cannot change its sharded parameters",
                 "after the unit's first forward")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # A conversion that changes nothing is no change.
    model.float()


def meta_state_dict_and_assign(rank: int, world: int) -> float:
    """Accelerate's cpu_ram_efficient_loading in torch's calls: a model built on the meta
    device and sharded; its state_dict() gives meta DTensors with FSDP2's shapes, meshes and
    placements; DTensors built from those placements (distribute_tensor of the full
    values) load with assign=True; then three steps equal FSDP2's. A value of another
    dtype is refused under assign=True (it would change the parameter's dtype)."""
    device = device_for_backend()
    mesh = init_device_mesh(device.type, (world,))
    full = {k: v.detach().clone() for k, v in _mlp(device).state_dict().items()}
    runs, layouts = {}, {}
    for system in ("ours", "fsdp2"):
        with torch.device("meta"):
            model = _mlp("meta")
        _shard(model, system, mesh)
        sd = model.state_dict()
        layouts[system] = {k: (type(v).__name__, tuple(v.shape), v.dtype, v.is_meta, tuple(v.placements),
                               v.device_mesh.device_type)
                           for k, v in sd.items()}
        loaded = {k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in sd.items()}
        result = model.load_state_dict(loaded, assign=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        for k, v in model.state_dict().items():
            assert torch.equal(_full(v), full[k]), f"{system}: '{k}' after load_state_dict(assign=True)"
        if system == "ours":
            wrong = {k: v.to(torch.float64) for k, v in loaded.items()}
            expect_error(lambda: model.load_state_dict(wrong, assign=True), RuntimeError, "assign=True",
                         "torch.float64", "torch.float32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        runs[system] = _train(model, optimizer, 3, device, torch.float32)
    assert layouts["ours"] == layouts["fsdp2"], (layouts["ours"], layouts["fsdp2"])
    _assert_same(runs["ours"], runs["fsdp2"], "meta + assign", 1e-5)
    return max(abs(a[0] - b[0]).item() for a, b in zip(runs["ours"], runs["fsdp2"]))


def accelerate_fsdp2_prepare(rank: int, world: int, system: str, case: str, tie: bool) -> dict:
    """Hugging Face Accelerate's own FSDP2 path (Accelerator.prepare: fsdp2_prepare_model,
    its optimizer switch; then backward, the steps, get_state_dict) on a small Llama,
    `system` "ours" patched in as a user swaps it (torch.distributed.fsdp.fully_shard =
    ours), or "fsdp2". On Gloo the Accelerator takes the job as MULTI_CPU and would ignore
    its FSDP plugin: its distributed type is set to FSDP after construction, so prepare()
    runs the FSDP2 code unchanged. Cases: "upcast" (a bf16 model under a bf16/fp32
    policy: prepare casts the sharded model to fp32) and "ram_efficient"
    (cpu_ram_efficient_loading: rank 0's weights reach the other ranks through a model
    sharded on meta, its state_dict() placements and load_state_dict(assign=True)).
    Returns per step the losses and full gradients, and the full state dict after (as
    lists: tensors would leave through shared memory the exiting rank takes with it)."""
    import torch.distributed.fsdp as torch_fsdp
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    fsdp2_fully_shard = torch_fsdp.fully_shard
    if system == "ours":
        torch_fsdp.fully_shard = mfsdp.fully_shard
    # Accelerate reads the job from torchrun's environment: without it each rank would
    # take itself for the only (main) process.
    torchrun_environment(rank, world)
    try:
        upcast = case == "upcast"
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
            cpu_ram_efficient_loading=case == "ram_efficient",
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32) if upcast else None)
        accelerator = Accelerator(cpu=True, mixed_precision="bf16" if upcast else "no", fsdp_plugin=plugin)
        if accelerator.distributed_type != DistributedType.FSDP:
            accelerator.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            accelerator.state.fsdp_plugin = plugin
        assert accelerator.is_fsdp2
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tie, attn_implementation="eager")
        # ram_efficient: the other ranks' weights differ; Accelerate must give them rank 0's.
        torch.manual_seed(0 if case != "ram_efficient" or rank == 0 else 1)
        model = LlamaForCausalLM(cfg)
        if upcast:
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        model, optimizer = accelerator.prepare(model, optimizer)
        layers_are = mfsdp.FSDPModule if system == "ours" else torch_fsdp.FSDPModule
        assert isinstance(model, layers_are) and isinstance(model.model.layers[0], layers_are)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        out = {"losses": [], "grads": []}
        for step in range(3):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            out["losses"].append(loss.item())
            out["grads"].append({n: _full(p.grad).detach().float().tolist() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        full_sd = accelerator.get_state_dict(model)
        out["state_dict"] = {k: v.detach().float().tolist() for k, v in full_sd.items()} if rank == 0 else None
        return out
    finally:
        torch_fsdp.fully_shard = fsdp2_fully_shard
        AcceleratorState._reset_state(True)
