"""FP8 training (torchao's Float8Linear) under our fully_shard against FSDP2 + torchao:
the same recipe, seed and data, both in bf16 mixed precision with the weights gathered in
bf16 (torchao's default; the FP8 gather is its own transform). Losses, full gradients and
parameters compared step by step."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import megatron_fsdp_ext as mfsdp

from .funcol_c10d import route_functional_collectives_through_c10d
from .tp_workers import full_of_ours, placements_of, worst_against_fsdp2
from .workers import device_for_backend, rel_err

D_IN, HIDDEN, D_OUT, ROWS = 64, 128, 32, 16  # FP8 matmuls want dims divisible by 16


def torchao_missing() -> str:
    """'' when torchao's float8 training imports here, else why not."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: report it)
        return f"{type(e).__name__}: {e}"
    return ""


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D_IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, D_IN)
        self.out = nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.out(F.gelu(self.mid(F.gelu(self.up(x)))))


def fp8_gathered(model: nn.Module, module_filter_fn=None) -> nn.Module:
    """`model`'s Linears (those `module_filter_fn(module, fqn)` keeps) converted in place by
    torchao's convert_to_float8_training with the FP8 all-gather on
    (Float8LinearConfig(enable_fsdp_float8_all_gather=True)); before fully_shard."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                      module_filter_fn=module_filter_fn)


def bf16_policy(system: str):
    """bf16 parameters and fp32 reduction (the FP8 tests' policy), in `system`'s class:
    "ours" or FSDP2's."""
    if system == "ours":
        return mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fp8_gathered_names(unit) -> List[str]:
    """The names of the parameters `unit` (one of ours) gathers in FP8 (its FP8 gather
    transform), sorted."""
    return sorted(spec.name for spec in unit.param_specs if "FP8" in str(spec.transform))


def _float8(recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = MLP().to(device_for_backend())
    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config)


def _shard_fsdp2(model: nn.Module, inner) -> nn.Module:
    """FSDP2 over `inner` units and the root, bf16 parameters and fp32 reduction (sums on
    Gloo, whose reduce-scatter has no average; FSDP2 divides after)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in inner:
        fully_shard(unit, mp_policy=torch_mp)
    fully_shard(model, mp_policy=torch_mp)
    if dist.get_backend() == "gloo":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _train_against_fsdp2(ours, theirs, rank: int, world: int, steps: int, what: str, *, rows: int = ROWS,
                         tol: float = 1e-6, first_exact: bool = False, after_step=None) -> Dict:
    """`steps` AdamW steps of both models on the same data (each rank its rows): losses and
    full gradients compared each step (relative error <= tol; with first_exact the first
    loss equal), parameters after; returns the worst errors."""
    placements = placements_of(ours)  # no tensor parallelism: every parameter Replicate
    device = device_for_backend()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(1)
    worst = {"first_loss_err": None, "loss": 0.0, "grad": 0.0}
    for step in range(steps):
        x, y = torch.randn(world * rows, D_IN, generator=g), torch.randn(world * rows, D_OUT, generator=g)
        mine = slice(rank * rows, (rank + 1) * rows)
        losses = []
        for m in (ours, theirs):
            loss = F.mse_loss(m(x[mine].to(device)).float(), y[mine].to(device))
            loss.backward()
            losses.append(loss.item())
        err = abs(losses[0] - losses[1]) / abs(losses[1])
        if step == 0:
            worst["first_loss_err"] = err
            assert not first_exact or err == 0.0, f"{what}, first forward: loss {losses[0]} vs {losses[1]}"
        assert err <= tol, f"{what}, step {step}: loss {losses[0]} vs FSDP2's {losses[1]}"
        worst["loss"] = max(worst["loss"], err)
        worst["grad"] = max(worst["grad"], worst_against_fsdp2(ours, theirs, "grad", placements, None, tol,
                                                               f"{what}, step {step}"))
        for o in opts:
            o.step()
            o.zero_grad()
        if after_step is not None:
            after_step()
    worst_against_fsdp2(ours, theirs, "value", placements, None, tol, f"{what}, after the steps")
    # Checkpoints and state dicts hold the fp32 master values, never FP8.
    sd = mfsdp.full_state_dict(ours, rank0_only=False)
    assert all(v.dtype == torch.float32 for v in sd.values()), {k: v.dtype for k, v in sd.items()}
    return worst


def float8_linear_parity(rank: int, world: int, recipes: List[str], steps: int = 3) -> Dict:
    """For each recipe: torchao Float8Linear layers sharded by ours and by FSDP2 (units:
    two layers and the root), bf16 parameters and fp32 reduction, AdamW."""
    from torchao.float8.float8_linear import Float8Linear

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":  # FSDP2's full_tensor() below
        route_functional_collectives_through_c10d()
    report = {}
    for recipe in recipes:
        ours, theirs = _float8(recipe), _float8(recipe)
        assert sum(isinstance(m, Float8Linear) for m in ours.modules()) == 3
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (ours.up, ours.mid):
            mfsdp.fully_shard(unit, mp_policy=mp)
        mfsdp.fully_shard(ours, mp_policy=mp)
        _shard_fsdp2(theirs, (theirs.up, theirs.mid))
        worst = _train_against_fsdp2(ours, theirs, rank, world, steps, f"{recipe}, FSDP2 + torchao")
        report[recipe] = worst
    return report


def float8_gather_extension_refused(rank: int, world: int) -> None:
    """Weights that ask for FSDP2's all-gather extension (torchao's
    enable_fsdp_float8_all_gather=True) are refused by name, not gathered as plain values."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from .workers import expect_error

    torch.manual_seed(0)
    model = convert_to_float8_training(MLP().to(device_for_backend()),
                                       config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    expect_error(lambda: mfsdp.fully_shard(model.up), NotImplementedError, "'weight'",
                 "WeightWithDynamicFloat8CastTensor", "enable_fsdp_float8_all_gather=False")


def _float8_gathered(seed: int = 0, model_fn=None) -> nn.Module:
    """The MLP converted with torchao's FP8 all-gather on (WeightWithDynamicFloat8CastTensor weights)."""
    torch.manual_seed(seed)
    return fp8_gathered((model_fn or MLP)().to(device_for_backend()), module_filter_fn=_not_pre)


def float8_gather_parity(rank: int, world: int, steps: int = 4, strategy: str = "optim_grads_params",
                         model_fn=None) -> Dict:
    """torchao's FP8 all-gather under ours (our gather transform) against FSDP2 + torchao
    (its fsdp_pre/post_all_gather, scales precomputed after each step): losses, gradients
    and parameters step by step; our gathers carry FP8 bytes for the weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":
        route_functional_collectives_through_c10d()
    ours, theirs = _float8_gathered(model_fn=model_fn), _float8_gathered(model_fn=model_fn)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in (ours.up, ours.mid):
        mfsdp.fully_shard(unit, mp_policy=mp, sharding_strategy=strategy)
    mfsdp.fully_shard(ours, mp_policy=mp, sharding_strategy=strategy)
    _shard_fsdp2(theirs, (theirs.up, theirs.mid))
    # Every weight of ours gathers in FP8, every bias in bf16.
    for m in (ours.up, ours.mid, ours):
        specs = m._fsdp_state.unit.param_specs
        kinds = {s.name.rsplit(".", 1)[-1]: str(s.transform) for s in specs}
        assert all(("FP8" in k) == (n == "weight") for n, k in kinds.items()), kinds
    seen = {}

    def record(module, args):
        seen[module] = type(module.weight)
    linears = [m for n, m in ours.named_modules() if n and not list(m.children())]
    hooks = [m.register_forward_pre_hook(record) for m in linears]
    worst = _train_against_fsdp2(ours, theirs, rank, world, steps, "FSDP2 + torchao FP8 gather",
                                 after_step=lambda: precompute_float8_dynamic_scale_for_fsdp(theirs))
    for h in hooks:
        h.remove()
    assert all(t is Float8TrainingTensor for t in seen.values()), seen
    return worst


class MLPWithTiny(MLP):
    """The MLP, a Float8Linear whose weight (512 elements) is smaller than some ranks'
    share of the root unit at world 3 (ranks holding none of it still take part), and a
    plain linear `pre` (not FP8: gathered in bf16 beside FP8 bytes) whose weight spans
    ranks in that unit."""

    def __init__(self):
        super().__init__()
        self.tiny = nn.Linear(D_OUT, 16)
        self.pre = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return self.tiny(super().forward(self.pre(x))).repeat(1, D_OUT // 16)


def _not_pre(module, fqn) -> bool:
    return fqn != "pre"


def float8_gather_uneven(rank: int, world: int, steps: int = 3) -> Dict:
    """The FP8 gather with uneven shards (MLPWithTiny at world 3: FSDP2 + torchao's FP8
    gather aborts there in Gloo with a size mismatch, so the reference is one process):
    each step, every rank's rows run through the plain modules with each FP8 weight made
    by torchao's own hp_tensor_and_scale_to_float8 from the full fp32 master and the
    scale torchao's precompute gives; the rank gradients are averaged in fp32 and AdamW
    steps the masters. Losses, full gradients and parameters compared step by step."""
    import copy

    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, \
        hp_tensor_and_scale_to_float8

    device = device_for_backend()
    ours = _shard_fp8_gathered(model_fn=MLPWithTiny)
    root = ours._fsdp_state.unit
    pre = next(i for i, sp in enumerate(root.param_specs) if sp.name == "pre.weight")
    spans = sum(root.layout.shard_slice(pre, r).numel > 0 for r in range(world))
    assert spans > 1 and str(root.param_specs[pre].transform).endswith("CAST"), (spans, root.param_specs[pre])
    torch.manual_seed(0)
    ref = MLPWithTiny().to(device)  # the same initial values (seed 0), plain fp32 modules
    fp8_layers = {n: m for n, m in ours.named_modules() if isinstance(m, Float8Linear)}
    ref_layers = {n: getattr(ref, n) for n in fp8_layers}
    opts = [torch.optim.AdamW(ours.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)]
    g = torch.Generator().manual_seed(1)
    worst = {"loss": 0.0, "grad": 0.0}

    def ref_forward(x):
        """ref's forward with bf16 compute: FP8 weights from the fp32 masters, biases in bf16."""
        weights = {}
        for n, lin in ref_layers.items():
            scale = amax_scale(lin.weight.detach())
            bits = hp_tensor_and_scale_to_float8(lin.weight.detach(), scale, torch.float8_e4m3fn,
                                                 fp8_layers[n].linear_mm_config, GemmInputRole.WEIGHT)
            w = nn.Parameter(Float8TrainingTensor(bits._data, bits._scale, torch.bfloat16,
                                                  fp8_layers[n].linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT))
            weights[n] = w
        swapped = copy.copy(ref_layers)
        outs = {}

        def run(n, h):
            lin, m = ref_layers[n], fp8_layers[n]
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
            y = matmul_with_hp_or_float8_args.apply(h, weights[n].t(), m.linear_mm_config, m.config)
            return y + lin.bias.to(torch.bfloat16)
        h = F.linear(x.to(torch.bfloat16), ref.pre.weight.to(torch.bfloat16), ref.pre.bias.to(torch.bfloat16))
        h = run("out", F.gelu(run("mid", F.gelu(run("up", h)))))
        outs["y"] = run("tiny", h).repeat(1, D_OUT // 16)
        del swapped
        return outs["y"], weights

    for step in range(steps):
        x, y = torch.randn(world * ROWS, D_IN, generator=g), torch.randn(world * ROWS, D_OUT, generator=g)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = F.mse_loss(ours(x[rows].to(device)).float(), y[rows].to(device))
        loss.backward()
        grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        ref_losses = []
        for r in range(world):
            part = slice(r * ROWS, (r + 1) * ROWS)
            out, weights = ref_forward(x[part].to(device))
            rl = F.mse_loss(out.float(), y[part].to(device))
            rl.backward()
            ref_losses.append(rl.item())
            for n, lin in ref_layers.items():
                grads[f"{n}.weight"] += weights[n].grad.float() / world
                grads[f"{n}.bias"] += lin.bias.grad.float() / world
                lin.bias.grad = None
            for n, p in ref.pre.named_parameters():
                grads[f"pre.{n}"] += p.grad / world
                p.grad = None
        err = abs(loss.item() - ref_losses[rank]) / abs(ref_losses[rank])
        assert err <= 1e-6, f"step {step}: loss {loss.item()} vs the reference's {ref_losses[rank]}"
        worst["loss"] = max(worst["loss"], err)
        mine = full_of_ours(ours, "grad", placements_of(ref), None)
        for n, gr in grads.items():
            e = rel_err(mine[n].reshape(gr.shape), gr)
            assert e <= 1e-5, f"step {step}: grad of '{n}' rel err {e:.3e} against the reference"
            worst["grad"] = max(worst["grad"], e)
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        for o in opts:
            o.step()
            o.zero_grad()
    # AdamW turns gradient differences of float rounding (the ranks' sum is ordered by the
    # backend) into parameter differences of up to lr x 1e-3 on near-zero gradients.
    mine = full_of_ours(ours, "value", placements_of(ref), None)
    for n, p in ref.named_parameters():
        e = rel_err(mine[n].reshape(p.shape), p)
        assert e <= 1e-4, f"after the steps: '{n}' rel err {e:.3e} against the reference"
    return worst


def amax_scale(w: torch.Tensor) -> torch.Tensor:
    """torchao's precompute_float8_dynamic_scale_for_fsdp scale of a full weight."""
    from torchao.float8.float8_utils import EPS
    amax = torch.clamp(w.abs().max().float(), EPS).to(torch.float64)
    return (torch.finfo(torch.float8_e4m3fn).max / amax).to(torch.float32)


def _shard_fp8_gathered(model_fn=None, gather: bool = True, **kwargs) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = convert_to_float8_training((model_fn or MLP)().to(device_for_backend()),
                                       config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather),
                                       module_filter_fn=_not_pre)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in ("up", "mid"):  # inner units where the model has them, then the root
        if hasattr(model, name):
            mfsdp.fully_shard(getattr(model, name), mp_policy=mp, **kwargs)
    mfsdp.fully_shard(model, mp_policy=mp, **kwargs)
    return model


def float8_gather_bytes(rank: int, world: int) -> Dict:
    """All-gather bytes of one training step (forward and backward gathers) with the FP8
    gather against the same model gathered in bf16, and what the byte layouts predict."""
    from megatron_fsdp_ext import _C

    device = device_for_backend()
    report = {}
    for gather in (True, False):
        # One all-gather per unit use is what is counted (no buckets).
        model = _shard_fp8_gathered(gather=gather, gather_bucket_bytes=0, reduce_bucket_bytes=0)
        x = torch.randn(ROWS, D_IN, device=device)
        model(x).float().square().mean().backward()  # lazy init and first gathers
        _C.reset_collective_counts()
        model(x).float().square().mean().backward()
        calls, nbytes = _C.collective_counts()["all_gather"]
        units = [m._fsdp_state.unit for m in (model.up, model.mid, model)]
        # Exact bytes a rank contributes once per unit (its own segment), per gather.
        exact = sum((u.gather_bytes.segment_bytes[u.rank] if u.gathers_bytes else
                     u.layout.segment_numels[u.rank] * 2) for u in units)
        report["fp8" if gather else "bf16"] = {"calls": calls, "bytes": nbytes, "contributed": exact,
                                               "unsharded": [u.unsharded_nbytes for u in units]}
    return report


def float8_gather_scales(rank: int, world: int) -> None:
    """When the scales are computed: after the optimizer step (its hook), before a
    forward that follows a load (stale), by refresh_fp8_scales, and by a gather of a stale
    unit (that unit alone). Each scale is torchao's for the full fp32 weight."""
    from torchao.float8.float8_utils import amax_to_scale

    device = device_for_backend()
    model = _shard_fp8_gathered()
    units = {"up": model.up._fsdp_state.unit, "mid": model.mid._fsdp_state.unit, "out": model._fsdp_state.unit}

    def check_scales(what):
        full = mfsdp.full_state_dict(model, rank0_only=False)
        for prefix, unit in units.items():
            assert not unit.fp8_scales_stale, f"{what}: {prefix} stale"
            for i, spec in enumerate(unit.param_specs):
                key = (f"{prefix}." if prefix != "out" else "") + spec.name
                if spec.name.endswith("weight"):
                    want = amax_to_scale(full[key].abs().max().float(), torch.float8_e4m3fn).to(device)
                    got = unit.fp8_scales[i]
                    assert torch.equal(got, want), f"{what}: scale of {key} {got.item()} vs torchao's {want.item()}"

    assert all(u.fp8_scales_stale for u in units.values())  # never computed
    x = torch.randn(ROWS, D_IN, device=device)
    model(x).float().square().mean().backward()
    check_scales("first forward")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-1)
    opt.step()
    check_scales("after the optimizer step")  # its hook refreshed them
    opt.zero_grad()
    # A load changes the shards: stale until the next forward or an explicit refresh.
    sd = {k: v * 3 for k, v in mfsdp.full_state_dict(model, rank0_only=False).items()}
    mfsdp.load_full_state_dict(model, sd)
    assert all(u.fp8_scales_stale for u in units.values())
    # A gather of a stale unit (here the C++ unit's own unshard) refreshes that unit alone.
    units["up"].unshard()
    units["up"].wait_unshard()
    assert not units["up"].fp8_scales_stale and units["mid"].fp8_scales_stale
    units["up"].reshard()
    mfsdp.refresh_fp8_scales(model)
    check_scales("refresh_fp8_scales")
    mfsdp.load_full_state_dict(model, sd)
    model(x).float().square().mean().backward()
    check_scales("forward after a load")
    # unshard() by hand refreshes too.
    mfsdp.load_full_state_dict(model, {k: v / 2 for k, v in sd.items()})
    model.up.unshard()
    assert not units["up"].fp8_scales_stale
    model.up.reshard()
    # A write through .data moves no version counter: handing .data out marks the shard
    # changed, so the scales follow it (a stale scale overflows or underflows the FP8 gather).
    for p in model.parameters():
        p.data.mul_(4.0)
    assert all(u.fp8_scales_stale for u in units.values())
    model(x).float().square().mean().backward()
    check_scales("forward after writes through .data")


class _GatherExtension(torch.Tensor):
    """A parameter subclass asking for FSDP2's all-gather extension (not torchao's)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data)

    def fsdp_pre_all_gather(self, mesh):
        return (self,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0], outputs


def float8_gather_refusals(rank: int, world: int) -> None:
    """Another subclass's FSDP2 gather extension is refused by name; so is torchao's FP8
    gather on a tensor-parallel weight, and two FP8 dtypes in one unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from .workers import expect_error

    device = device_for_backend()
    plain = MLP().to(device)
    plain.up.weight = nn.Parameter(_GatherExtension(plain.up.weight.detach()))
    expect_error(lambda: mfsdp.fully_shard(plain.up), NotImplementedError, "'weight'", "_GatherExtension",
                 "fsdp_pre_all_gather")
    tp = _float8_gathered()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    dp_tp = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
    w = tp.up.weight
    tp.up.weight = nn.Parameter(DTensor.from_local(w[rank * (HIDDEN // world):(rank + 1) * (HIDDEN // world)],
                                                   mesh, [Shard(0)], run_check=False))
    expect_error(lambda: mfsdp.fully_shard(tp.up, mesh=dp_tp["dp"]), NotImplementedError, "'weight'",
                 "tensor-parallel", "enable_fsdp_float8_all_gather=False")
    from torchao.float8.config import CastConfig

    mixed = MLP().to(device)
    convert_to_float8_training(mixed, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: fqn == "up")
    convert_to_float8_training(mixed, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True, cast_config_weight=CastConfig(target_dtype=torch.float8_e5m2)),
        module_filter_fn=lambda m, fqn: fqn == "mid")
    assert mixed.mid.weight._dtype == torch.float8_e5m2
    expect_error(lambda: mfsdp.fully_shard([mixed.up, mixed.mid]), ValueError, "share an FP8 dtype")


def float8_gather_estimate(rank: int, world: int) -> Dict:
    """estimate_memory's gathered bytes for a model with FP8-gathered weights (one unit
    per Float8Linear, strategy optim_grads: every unit's copy is kept) equal what the
    units allocate; the bf16-gathered model's are about twice as large."""
    from torchao.float8.float8_linear import Float8Linear

    device = device_for_backend()
    out = {}
    for gather in (True, False):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        torch.manual_seed(0)
        model = convert_to_float8_training(MLP().to(device),
                                           config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather))
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        est = mfsdp.estimate_memory(model, world, unit_modules=[Float8Linear], sharding_strategy="optim_grads",
                                    mp_policy=mp)
        for m in (model.up, model.mid, model.out):
            mfsdp.fully_shard(m, mp_policy=mp, sharding_strategy="optim_grads")
        mfsdp.fully_shard(model, mp_policy=mp, sharding_strategy="optim_grads")
        model(torch.randn(ROWS, D_IN, device=device)).float().sum().backward()
        allocated = sum(m._fsdp_state.unit.unsharded_storage_bytes for m in (model.up, model.mid, model.out))
        assert est.gathered_params == allocated, (gather, est.gathered_params, allocated)
        out["fp8" if gather else "bf16"] = allocated
    return out


class Wide(nn.Module):
    """Float8Linear weights of many chunks each (the fused amax
    and fill kernels split pieces into 16384-element chunks, one block a chunk), with
    row counts that do not divide by the world."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 4112)
        self.b = nn.Linear(4112, 1040, bias=False)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def float8_gather_bits(rank: int, world: int) -> Dict:
    """The gathered FP8 bytes and scales are torchao's: each weight's gathered data equals
    hp_tensor_and_scale_to_float8 of its full fp32 master with torchao's precompute scale,
    bit for bit (the fused CUDA kernels on GPU, ATen on CPU); the bias (bf16) its cast.
    A NaN in a weight makes its scale NaN, as torchao's precompute does."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    device = device_for_backend()
    model = _shard_fp8_gathered(model_fn=Wide)
    unit = model._fsdp_state.unit
    full = mfsdp.full_state_dict(model, rank0_only=False)
    model.unshard()
    checked = {}
    for i, spec in enumerate(unit.param_specs):
        u = unit.unsharded_params[i]
        master = full[spec.name].to(device)
        if spec.name.endswith("weight"):
            scale = amax_scale(master)
            want = hp_tensor_and_scale_to_float8(master, scale, torch.float8_e4m3fn, None, GemmInputRole.WEIGHT)
            assert torch.equal(u._scale, scale), (spec.name, u._scale, scale)
            got, exp = u._data.view(torch.uint8), want._data.view(torch.uint8)
            assert torch.equal(got, exp), f"{spec.name}: {(got != exp).sum().item()} FP8 bytes differ from torchao's"
        else:
            assert torch.equal(u.detach(), master.to(torch.bfloat16)), spec.name
        checked[spec.name] = master.numel()
    model.reshard()
    # NaN on the first rank's piece, then on the last rank's: each must reach every rank
    # (a backend's float max may drop NaN: NCCL's does).
    for name, where in (("a.weight", (5, 7)), ("b.weight", (-1, -1))):
        nan = dict(full)
        nan[name] = nan[name].clone()
        nan[name][where] = float("nan")
        mfsdp.load_full_state_dict(model, nan)
        mfsdp.refresh_fp8_scales(model)
        scales = {spec.name: unit.fp8_scales[i].item() for i, spec in enumerate(unit.param_specs)}
        other = "b.weight" if name == "a.weight" else "a.weight"
        assert scales[name] != scales[name], (name, scales)  # NaN
        assert scales[other] == amax_scale(nan[other].to(device)).item(), (name, scales)
    return checked


# ------------------------------------------------------------------------------ MXFP8

MX_ROWS = 32  # tokens per rank: torchao's MXFP8 backward quantizes along the token dim too


class MXMLP(nn.Module):
    """Weights whose last dims are multiples of 32 (MX blocks) and whose sizes do not split
    evenly over 3 ranks; a 16-element gain; with `bias`, bf16 biases beside MX weights in a unit. (torchao's
    MXFP8 weight wrapper drops F.linear's bias, so comparisons with torchao use none.)"""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(D_IN, 160, bias=bias)
        self.down = nn.Linear(160, 96, bias=False)
        self.out = nn.Linear(96, D_OUT, bias=bias)
        # A parameter smaller than one MX block (16 elements), gathered in bf16 in the
        # root unit beside MXFP8 weights.
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D_OUT // 2))

    def forward(self, x):
        return self.out(F.gelu(self.down(F.gelu(self.up(x))))) * self.gain.repeat(2)


def mx_missing() -> str:
    """'' when torchao's MXFP8 training imports here, else why not."""
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig  # noqa: F401
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def _mx_model(model_fn=None) -> nn.Module:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    torch.manual_seed(0)
    model = (model_fn or MXMLP)().to(device_for_backend())
    # Emulated: the MX matmuls dequantize (no MX hardware before Blackwell); the quantization is the same.
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    try:
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    except AssertionError as e:
        if "nightly" not in str(e):
            raise
        # torchao 0.18 gates MXFP8 training on torch >= 2.12 (the GPU machine has 2.11):
        # wrap the parameters as its quantize_ does, to run the same code paths there.
        for m in model.modules():
            if isinstance(m, nn.Linear):
                for name, p in list(m.named_parameters(recurse=False)):
                    setattr(m, name, nn.Parameter(MXFP8TrainingWeightWrapperTensor(p.detach(), config)))
    return model


def _shard_mx(model) -> nn.Module:
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mfsdp.fully_shard(model.up, mp_policy=mp)
    mfsdp.fully_shard(model, mp_policy=mp)
    return model


def mx_gather_bits(rank: int, world: int) -> Dict:
    """Block-aligned shards: every rank's piece of an MXFP8 weight is whole 32-element
    blocks, so the gathered FP8 data and E8M0 scales, each rank quantizing only its own
    blocks, equal torchao's MXTensor.to_mx of the whole bf16 weight bit for bit. No
    all-reduce is issued for them."""
    from megatron_fsdp_ext import _C
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    device = device_for_backend()
    model = _shard_mx(_mx_model())
    full = mfsdp.full_state_dict(model, rank0_only=False)
    checked = {}
    for prefix, m in (("up.", model.up), ("", model)):
        unit = m._fsdp_state.unit
        assert unit.mx_block == 32 and unit.layout.alignment % 32 == 0
        for i, spec in enumerate(unit.param_specs):
            if not str(spec.transform).endswith("MXFP8"):
                continue
            for r in range(world):
                sl = unit.layout.shard_slice(i, r)
                assert sl.param_offset % 32 == 0 and sl.numel % 32 == 0, (spec.name, r, sl.param_offset, sl.numel)
    _C.reset_collective_counts()
    model.up.unshard()
    model.unshard()
    assert _C.collective_counts()["all_reduce"][0] == 0  # no amax all-reduce
    for prefix, m in (("up.", model.up), ("", model)):
        unit = m._fsdp_state.unit
        for i, spec in enumerate(unit.param_specs):
            u = unit.unsharded_params[i]
            master = full[prefix + spec.name].to(device)
            if str(spec.transform).endswith("MXFP8"):
                want = MXTensor.to_mx(master.to(torch.bfloat16), torch.float8_e4m3fn, 32, u._mx_config.scale_calculation_mode,
                                      u._mx_config.kernel_preference)
                got_d, want_d = u._mx_data.view(torch.uint8), want.qdata.view(torch.uint8)
                got_s, want_s = u._mx_scale.view(torch.uint8), want.scale.view(torch.uint8).reshape(u._mx_scale.shape)
                assert torch.equal(got_s, want_s), f"{spec.name}: {(got_s != want_s).sum().item()} E8M0 scales differ"
                assert torch.equal(got_d, want_d), f"{spec.name}: {(got_d != want_d).sum().item()} FP8 bytes differ"
                checked[prefix + spec.name] = master.numel()
            else:
                assert torch.equal(u.detach(), master.to(torch.bfloat16)), spec.name
    # F.linear on the gathered weight is torchao's MXFP8 matmul of the whole bf16 weight,
    # plus the bias (which torchao's own wrapper drops).
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

    unit = model.up._fsdp_state.unit
    weight, bias = unit.unsharded_params
    cfg = weight._mx_config
    x = torch.randn(MX_ROWS, D_IN, device=device, dtype=torch.bfloat16)
    want = _to_mxfp8_then_scaled_mm(x, full["up.weight"].to(device, torch.bfloat16), cfg.kernel_preference,
                                    cfg.scale_calculation_mode) + full["up.bias"].to(device, torch.bfloat16)
    got = F.linear(x, weight, bias)
    assert torch.equal(got, want), f"F.linear on the MXFP8-gathered weight: max diff {(got - want).abs().max()}"
    model.up.reshard()
    model.reshard()
    # A load makes the quantized shard stale: a gather of the C++ unit refuses (it is
    # quantized in Python) until refresh_fp8_scales or the root's forward re-quantizes.
    from .workers import expect_error

    mfsdp.load_full_state_dict(model, {k: v * 2 for k, v in full.items()})
    assert unit.fp8_scales_stale
    expect_error(lambda: unit.unshard(), RuntimeError, "quantized MXFP8 shard is older than its shard")
    mfsdp.refresh_fp8_scales(model)
    assert not unit.fp8_scales_stale
    return checked


def mx_parity(rank: int, world: int, steps: int = 3) -> Dict:
    """MXFP8 with the block-aligned MX gather (ours) against FSDP2 + torchao's MXFP8
    (bf16 gather), same recipe, seed and data: the forward is the same computation on the
    same FP8 values (first loss equal); backward's grad_input uses the weight dequantized
    from its MX blocks (torchao: the bf16 weight), so gradients and later losses agree
    within the MX quantization error, which this reports."""
    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":
        route_functional_collectives_through_c10d()

    def biasless():
        return MXMLP(bias=False)
    ours, theirs = _shard_mx(_mx_model(biasless)), _mx_model(biasless)
    _shard_fsdp2(theirs, (theirs.up,))
    return _train_against_fsdp2(ours, theirs, rank, world, steps, "FSDP2 + torchao MXFP8", rows=MX_ROWS,
                                tol=2e-2, first_exact=True)


def mx_refusals(rank: int, world: int) -> None:
    """An MXFP8 weight whose last dim is not a multiple of 32 is refused by name; one unit
    may not mix tensorwise FP8 and MXFP8 weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    from .workers import expect_error

    device = device_for_backend()
    odd = nn.Linear(48, 64).to(device)
    cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    odd.weight = nn.Parameter(MXFP8TrainingWeightWrapperTensor(odd.weight.detach(), cfg))
    expect_error(lambda: mfsdp.fully_shard(odd), ValueError, "weight", "multiple of 32")
    mixed = _mx_model()
    convert_to_float8_training(mixed, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: False)  # nothing: build a tensorwise one by hand
    from torchao.float8.float8_linear import Float8Linear
    tw = Float8Linear.from_float(nn.Linear(96, D_OUT).to(device),
                                 config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mixed.out = tw
    expect_error(lambda: mfsdp.fully_shard(mixed), ValueError, "both tensorwise FP8 and MXFP8")


def mx_estimate(rank: int, world: int) -> int:
    """estimate_memory's gathered bytes for MXFP8 units (strategy optim_grads keeps every
    copy) equal what the units allocate: FP8 data, bf16 biases, one scale byte a block."""
    model = _mx_model()
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    est = mfsdp.estimate_memory(model, world, unit_modules=[nn.Linear], sharding_strategy="optim_grads", mp_policy=mp)
    for m in (model.up, model.down, model.out):
        mfsdp.fully_shard(m, mp_policy=mp, sharding_strategy="optim_grads")
    mfsdp.fully_shard(model, mp_policy=mp, sharding_strategy="optim_grads")
    model(torch.randn(MX_ROWS, D_IN, device=device_for_backend())).float().sum().backward()
    allocated = sum(m._fsdp_state.unit.unsharded_storage_bytes for m in (model.up, model.down, model.out, model))
    assert est.gathered_params == allocated, (est.gathered_params, allocated)
    return allocated


def float8_gather_compiled(rank: int, world: int, backend: str = "aot_eager") -> List[float]:
    """The FP8 gather under torch.compile: the sharded Float8Linear units compiled with
    fullgraph=True train exactly as the same model in eager (losses and parameters)."""
    device = device_for_backend()
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _shard_fp8_gathered()
        if compiled:
            for m in (model.up, model.mid):
                m.compile(fullgraph=True, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, D_OUT, generator=g)
            loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, mfsdp.full_state_dict(model, rank0_only=False)))
    (eager, eager_sd), (comp, comp_sd) = runs
    assert comp == eager, f"compiled losses {comp} vs eager {eager}"
    for k, v in eager_sd.items():
        assert torch.equal(comp_sd[k], v), f"'{k}' differs after compiled training"
    return comp
