"""torchtitan's training loop on a mixture-of-experts job: Trainer.train_step on its
DeepSeek-V3 debugmodel job (config_registry.deepseek_v3_debugmodel), parallelized by its
own parallelize_deepseekv3 with expert parallelism, FSDP2 and ours (the `fully_shard`
swap) side by side on the same ranks.

What the loop adds over tests/harness/moe_workers.py's hand-written one:
- the loss summed over tokens and divided by the GLOBAL count of valid tokens, gradient
  accumulation, torchtitan's AdamW and LR-schedule containers;
- its clip_grad_norm_ with `ep_enabled` (its EP path: every parameter and gradient must be
  a DTensor, experts told apart by an "ep" mesh dim, the two norms combined), clipping
  active at every step;
- the model spec's post_optimizer_build_fn: the auxiliary-loss-free load balancing hook,
  which before every optimizer step all-reduces each MoE layer's tokens_per_expert_E over
  the loss mesh and moves its expert_bias_E (buffers: they must stay plain, unsharded and
  identical across ranks under ours, as under FSDP2), which steers the next step's routing.

Routed experts compute in fp32 on both sides (moe_workers.use_fp32_experts), as in
tests/distributed/test_moe.py.
"""
from __future__ import annotations

import time
from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .moe_workers import _compare_full, _model_parallel_layouts, use_fp32_experts
from .titan_workers import _built_model, _compare_rows, _setup, _titan_trainer, _train, check_titan_reached_ours
from .tp_workers import plain_name

EXPERT_BIAS = "expert_bias_E"
TOKENS_PER_EXPERT = "tokens_per_expert_E"


def _buffers(model, suffix: str) -> Dict[str, torch.Tensor]:
    """{name: local value in float64} of the model's buffers whose name ends in `suffix`."""
    out = {}
    for n, b in model.named_buffers():
        if n.endswith(suffix):
            out[plain_name(n)] = (b.to_local() if isinstance(b, DTensor) else b).detach().double().cpu()
    return out


def _same_on_every_rank(values: Dict[str, torch.Tensor], what: str) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    for rank, theirs in enumerate(every):
        for name, t in values.items():
            assert torch.equal(theirs[name], t), f"{what} '{name}' differs between rank {rank} and rank {dist.get_rank()}"


def titan_moe_trainer_vs_fsdp2(rank: int, world: int, parallelism: Dict, steps: int = 6, max_norm: float = 0.25,
                               local_bs: int = 2, accum: int = 2, ac: bool = True, tol: float = 1e-5,
                               from_meta: bool = False) -> Dict:
    """torchtitan's train_step on its DeepSeek-V3 debugmodel job with `parallelism` (a
    ParallelismConfig's fields: dp shard / replicate, expert_parallel_degree), FSDP2 and
    ours step by step: the global loss, the max local loss, the grad norm of its EP clip
    and the lr within `tol` relative at every step (clipping active at every step); after
    the last step every parameter's full (clipped) gradient and full value within 10 * tol,
    and the load-balancing buffers: every MoE layer's expert_bias_E equal between the two
    systems (to `tol`, relative to its largest entry), the same on every rank, moved from
    zero by the hook, and tokens_per_expert_E zeroed by it. from_meta: both models built
    on meta as torchtitan's Trainer builds them (to_empty, init_states), then loaded with
    the same weights.
    Returns (the same on every rank) {"worst": {...}, "curves": {...}, "units", "moved",
    "expert_bias_moved", "moe_layers", "wall_s"}."""
    wall0 = time.perf_counter()
    dims, cfg = _setup(world, parallelism, steps=steps, max_norm=max_norm, local_bs=local_bs, accum=accum,
                       loss="ce", ac=ac, model="dsv3")  # first: it installs the import stubs
    use_fp32_experts()
    assert dims.ep_enabled == (parallelism.get("expert_parallel_degree", 1) > 1)
    init = {plain_name(n): p.detach().double().cpu() for n, p in _built_model(cfg).named_parameters()}
    runs = {impl: _titan_trainer(cfg, dims, impl, from_meta=from_meta) for impl in ("fsdp2", "ours")}
    fsdp2_model, ours_model = runs["fsdp2"].model_parts[0], runs["ours"].model_parts[0]
    units = check_titan_reached_ours(ours_model, fsdp2_model)
    for impl, t in runs.items():  # the spec's post_optimizer_build_fn registered the load-balancing hook
        hooks = sum(len(o._optimizer_step_pre_hooks) for o in t.optimizers.optimizers) + \
            len(getattr(t.optimizers, "_optimizer_step_pre_hooks", {}))
        assert hooks >= 1, f"{impl}: no optimizer step pre-hook: torchtitan's MoE load balancing is not on"
    bias0 = _buffers(ours_model, EXPERT_BIAS)
    assert bias0 and all(float(b.abs().max()) == 0.0 for b in bias0.values()), "expert biases start at zero"

    curves = {"fsdp2": [], "ours": []}
    worst: Dict[str, float] = {}
    for step in range(1, steps + 1):
        ref, got = _train(runs["fsdp2"], 1)[0], _train(runs["ours"], 1)[0]
        curves["fsdp2"].append(ref)
        curves["ours"].append(got)
        _compare_rows(got, ref, step, tol, worst)
    clipped = sum(r["grad_norm"] > max_norm for r in curves["fsdp2"])
    assert clipped == steps, f"clipping active on {clipped} of {steps} steps only (max_norm {max_norm})"

    shapes = {plain_name(n): p.shape for n, p in fsdp2_model.named_parameters()}
    layouts = _model_parallel_layouts(fsdp2_model)
    pair = (("fsdp2", fsdp2_model), ("ours", ours_model))
    g = _compare_full(pair, "grad", shapes, layouts)
    v = _compare_full(pair, "value", shapes, layouts, init if rank == 0 else None)
    worst["grad"], worst["param"] = g["max_rel"], v["max_rel"]
    assert worst["grad"] <= 10 * tol, f"clipped gradients after step {steps}: '{g['at']}' ours vs FSDP2 rel {worst['grad']:.2e}"
    assert worst["param"] <= 10 * tol, f"parameters after {steps} steps: '{v['at']}' ours vs FSDP2 rel {worst['param']:.2e}"
    assert v["moved"] > 1e-3, f"parameters moved by {v['moved']:.2e} only"

    biases = {impl: _buffers(m, EXPERT_BIAS) for impl, m in (("fsdp2", fsdp2_model), ("ours", ours_model))}
    assert sorted(biases["ours"]) == sorted(biases["fsdp2"]), \
        f"expert-bias buffers: ours {sorted(biases['ours'])} vs FSDP2 {sorted(biases['fsdp2'])}"
    worst["expert_bias"] = 0.0
    for name, ref in biases["fsdp2"].items():
        scale = float(ref.abs().max())
        assert scale > 0, f"FSDP2's '{name}' never moved: the load-balancing hook did not run"
        err = float((biases["ours"][name] - ref).abs().max()) / scale
        worst["expert_bias"] = max(worst["expert_bias"], err)
        assert err <= tol, f"'{name}': ours vs FSDP2 max rel {err:.2e}"
    _same_on_every_rank(biases["ours"], "our expert bias")
    for name, t in _buffers(ours_model, TOKENS_PER_EXPERT).items():
        assert float(t.abs().max()) == 0.0, f"'{name}' not zeroed after the step: the hook did not run on ours"
    return {"worst": worst, "curves": curves, "units": units, "moved": v["moved"],
            "expert_bias_moved": min(float(b.abs().max()) for b in biases["fsdp2"].values()),
            "moe_layers": len(biases["fsdp2"]), "wall_s": time.perf_counter() - wall0}
