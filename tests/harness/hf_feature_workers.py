"""Workers for tests/distributed/test_hf_features.py: Hugging Face causal LMs (tiny
LlamaForCausalLM and Qwen3ForCausalLM built from configs, tied embeddings, fp32) sharded
per decoder layer + root as FSDP2 users do it, under ZeRO-1 / no shard, CPU offload,
torch.compile, explicit buckets (ours only: FSDP2 runs its default) and tensor
parallelism (dp 2 x tp 2 at world 4: transformers' own Llama TP plan through torch's
parallelize_module on "tp", then fully_shard on "dp"). Each configuration trains against
one plain process fed every rank's rows (the loss, every full gradient and the global
grad norm every step, the parameters after) and, where FSDP2 runs the same setting,
against FSDP2 under the same code.

The batches are left-padded (attention_mask 0 on the pads, labels -100 there), so the
mask changes what every real token attends to, and the loss is HF's own (`labels=`):
each rank passes `num_items_in_batch=` the global count of predicted tokens divided by
the world size (what HF's Trainer does with average_tokens_across_devices), so the ranks'
mean gradient, which the reduction gives, is the global batch's token mean: the plain
model's `labels=` loss on all rows."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.param_index import iter_states

VOCAB, ROWS, SEQ, PAD = 64, 4, 8, 0
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-6)


def build(arch: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=PAD)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    return model


def batch(step: int):
    """Left-padded rows: input ids, attention mask, labels (-100 on the pads)."""
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(3, SEQ, (ROWS,), generator=g)
    lengths[step % ROWS] = SEQ  # one full row, the others padded
    mask = (torch.arange(SEQ) >= SEQ - lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return ids, mask, ids.masked_fill(mask == 0, -100)


class RecordingBackend:
    """aot_eager, keeping the ops of every graph Dynamo hands over."""

    def __init__(self):
        self.graph_ops: List[str] = []

    def __call__(self, gm, example_inputs):
        self.graph_ops.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return aot_eager(gm, example_inputs)


def shard(model, system: str, case: Dict, world: int, backend=None, dp_mesh=None):
    """FSDP2 users' way: each decoder layer, then the root (whose unit holds the tied
    embedding and the final norm). `system`: "ours" or "fsdp2". With TP (`dp_mesh`
    given) both shard on the data-parallel mesh; explicit buckets are ours only (FSDP2
    runs its default). Returns the module to call (compiled or not)."""
    if system == "ours":
        fully_shard = mfsdp.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    kwargs = {}
    if dp_mesh is not None:
        kwargs["mesh"] = dp_mesh
    if system == "ours" and case.get("buckets"):
        kwargs.update(gather_bucket_bytes=case["buckets"], reduce_bucket_bytes=case["buckets"])
    if case.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    strategy = case.get("strategy")
    if system == "ours" and strategy:
        kwargs["sharding_strategy"] = strategy
    elif strategy == "no_shard":  # FSDP2's replication: HSDP over shard groups of one rank
        kwargs["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    elif strategy == "optim_grads":  # FSDP2's ZeRO-2
        kwargs["reshard_after_forward"] = False
    else:
        assert strategy is None, f"FSDP2 has no {strategy!r}"
    layers = list(model.model.layers)
    if case.get("compile") == "layers":  # torchtitan's way: compile each block, then shard
        for layer in layers:
            layer.compile(backend=backend, fullgraph=True)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if case.get("compile") == "model":  # the whole model, after sharding
        return torch.compile(model, backend=backend)
    return model


def _full_values(model, system: str) -> Dict[str, torch.Tensor]:
    if system == "ours":
        return mfsdp.full_state_dict(model, rank0_only=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _grad_norm(model, system: str, tp: bool = False) -> torch.Tensor:
    if system == "ours":
        return mfsdp.clip_grad_norm_(model, 1e9)
    if tp:  # torch's clip fails under FSDP2 + TP (it stacks norms on the 2-D and the 1-D mesh)
        return torch.stack([p.grad.full_tensor().pow(2).sum() for p in model.parameters()]).sum().sqrt()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _close(a, b, what: str):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _check_units(model, case: Dict, what: str) -> None:
    """What ran is the configuration: every unit (two layers, the root) took the options."""
    states = list(iter_states(model))
    assert len(states) == 3, (what, states)
    for s in states:
        assert s.options.sharding_strategy == case.get("strategy", "optim_grads_params"), (what, s)
        assert s.unit.offloaded == bool(case.get("offload")), (what, s)


def _check_behaviour(model, case: Dict, counts: Dict, what: str) -> None:
    """What the options do, seen in one steady step (after the first optimizer step):
    the collectives each strategy issues (Megatron-FSDP's definitions) and, offloaded,
    the host buffers each unit keeps."""
    states = list(iter_states(model))
    grad_bytes = 4 * sum(p.numel() for s in states for p in s.unsharded_params)
    calls = {k: v[0] for k, v in counts.items()}
    nbytes = {k: v[1] for k, v in counts.items()}
    strategy = case.get("strategy", "optim_grads_params")
    if strategy in ("no_shard", "optim"):  # full gradients all-reduced, nothing reduce-scattered
        assert calls["reduce_scatter"] == 0 and nbytes["all_reduce"] >= grad_bytes, (what, counts, grad_bytes)
    else:
        assert calls["reduce_scatter"] > 0 and nbytes["all_reduce"] < 1024, (what, counts)
    # no_shard never gathers; the others gather the shards the optimizer changed.
    assert (calls["all_gather"] > 0) == (strategy != "no_shard"), (what, counts)
    if case.get("buckets"):  # the budgets reached the root and cut the units into shared buckets
        assert model.bucket_budgets() == (case["buckets"], case["buckets"]), (what, model.bucket_budgets())
        schedule = model._fsdp_state.ctx.schedule
        for plan in (schedule._gathers, schedule._reductions):
            sizes = sorted(len(b) for b in plan.buckets)
            assert len(sizes) >= 2 and sizes[-1] >= 2, (what, [[m.label for m in b] for b in plan.buckets])
        # One coalesced reduce-scatter per bucket, not one per unit.
        assert calls["reduce_scatter"] == len(schedule._reductions.buckets) < len(states), (what, counts)
    for s in states:
        held = s.unit.unsharded_storage_bytes
        if strategy == "no_shard":
            assert all(p.detach().numel() == u.numel() for p, u in zip(s.sharded_params, s.unsharded_params)), what
        assert (held > 0) == (strategy in ("optim", "optim_grads")), (what, s, held)
        if case.get("offload"):  # the shard and a kept host buffer behind the gradients
            u = s.unit
            assert u.sharded_flat.device.type == "cpu" and u.host_nbytes == 2 * u.sharded_flat.nbytes, \
                (what, s, u.host_nbytes, u.sharded_flat.nbytes)


def _reference(ref) -> List[Dict]:
    """The plain model on every row: loss, gradients, grad norm of each step; SGD."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(STEPS):
        ids, mask, labels = batch(step)
        loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        out.append({"loss": loss.detach(), "norm": norm,
                    "grads": {n: p.grad.clone() for n, p in ref.named_parameters()}})
        opt.step()
        opt.zero_grad()
    return out


def _tp_plan(model) -> Dict:
    """Transformers' own Llama plan (base_model_tp_plan) in torch's styles: q, k, v and
    the MLP's gate and up column-wise, o and down row-wise; the tied embedding, the norms
    and the head stay whole (sharded over dp only)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def _tp_full_grads(model, placements, tp_mesh) -> Dict[str, torch.Tensor]:
    """Ours' full gradients rebuilt from every rank's 1-D pieces and the TP placements,
    with nothing of the library's own gather (tp_workers.full_of_ours)."""
    from .tp_workers import full_of_ours
    return {n: g.float() for n, g in full_of_ours(model, "grad", placements, tp_mesh).items()}


def _train(rank: int, world: int, arch: str, system: str, case: Dict, expected: List[Dict], ref, what: str,
           mesh=None):
    from torch._dynamo.utils import counters

    dp_index, dp_world = rank, world
    tp_mesh = dp_mesh = placements = None
    if mesh is not None:  # dp x tp: the rows follow the data-parallel coordinate
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        dp_index, dp_world = mesh.get_coordinate()[0], mesh.size(0)
    per = ROWS // dp_world
    rows = slice(dp_index * per, (dp_index + 1) * per)
    torch._dynamo.reset()
    counters.clear()
    backend = RecordingBackend()
    model = build(arch)
    if tp_mesh is not None:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import parallelize_module

        from .tp_workers import placements_of
        parallelize_module(model, tp_mesh, _tp_plan(model))
        placements = placements_of(model)
        assert sum(isinstance(p, DTensor) for p in model.parameters()) == 7 * len(model.model.layers), what
    run = shard(model, system, case, world, backend, dp_mesh)
    if system == "ours":
        _check_units(model, case, what)
        if dp_mesh is not None:  # every unit sharded over the 2 dp ranks, not the 4
            assert all(s.unit.world_size == 2 for s in iter_states(model)), what
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, want in enumerate(expected):
        ids, mask, labels = batch(step)
        tokens = (labels[:, 1:] != -100).sum()
        before = dict(_C.collective_counts())
        loss = run(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows],
                   num_items_in_batch=tokens / dp_world).loss
        loss.backward()
        counts = {k: (v[0] - before[k][0], v[1] - before[k][1]) for k, v in _C.collective_counts().items()}
        total = loss.detach().clone()
        dist.all_reduce(total)
        at = f"{what}, step {step}"
        _close(total / world, want["loss"], f"{at}, loss")
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(want["grads"]), (at, set(grads) ^ set(want["grads"]))
        for n, g in grads.items():
            _close(g, want["grads"][n], f"{at}, grad of {n}")
        if system == "ours" and tp_mesh is not None:  # the same, rebuilt from the raw pieces
            for n, g in _tp_full_grads(model, placements, tp_mesh).items():
                _close(g, want["grads"][n], f"{at}, grad of {n} (from the pieces)")
        _close(_grad_norm(model, system, tp_mesh is not None), want["norm"], f"{at}, grad norm")
        if system == "ours" and step == 1:
            _check_behaviour(model, case, counts, at)
        opt.step()
        opt.zero_grad()
    if case.get("compile"):
        # The layers' attention ran in compiled graphs; under whole-model compile ours
        # breaks the graph only at its unit hooks (FSDP2's breaks are its own).
        assert any("scaled_dot_product_attention" in ops for ops in backend.graph_ops), (what, backend.graph_ops)
        if case["compile"] == "layers":
            assert not counters["graph_break"], (what, dict(counters["graph_break"]))
        elif system == "ours":
            assert counters["graph_break"], f"{what}: the unit hooks should break the whole-model graph"
            for reason in counters["graph_break"]:
                assert "megatron_fsdp_ext unit hooks" in reason, f"{what}: graph break inside a unit: {reason}"
    return model


def _generate(model, system: str, ref, what: str) -> None:
    """Greedy generate() (KV cache, left-padded prompts) through the registered forward
    method: the plain model's tokens and the logits of every new token (ref holds the
    same trained values)."""
    prompt, mask, _ = batch(7)
    prompt, mask = prompt[:, 3:], mask[:, 3:]
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                  return_dict_in_generate=True, output_logits=True)
    ref.eval()
    model.eval()
    want = ref.generate(prompt, **kwargs)
    if system == "ours":
        mfsdp.register_fsdp_forward_method(model, "generate")
    else:
        from torch.distributed.fsdp import register_fsdp_forward_method
        register_fsdp_forward_method(model, "generate")
    got = model.generate(prompt, **kwargs)
    assert got.sequences.shape == (ROWS, SEQ - 3 + 4), (what, got.sequences.shape)
    assert torch.equal(got.sequences, want.sequences), (what, got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == 4, what
    for i, (a, b) in enumerate(zip(got.logits, want.logits)):
        _close(a, b, f"{what}, generate, logits of new token {i}")


def hf_features(rank: int, world: int, arch: str, cases: Dict[str, Dict]) -> bool:
    """Each case: ours, then FSDP2 where it runs the setting (case["fsdp2"], default
    True), each from the same initial values, against one plain process. A case with
    "tp" runs on a dp 2 x tp 2 mesh (world 4): transformers' Llama plan through torch's
    parallelize_module on "tp", then both systems' fully_shard on "dp"."""
    mesh = None
    if any(case.get("tp") for case in cases.values()):
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for name, case in cases.items():
        ref = build(arch)
        expected = _reference(ref)
        for system in ["ours"] + (["fsdp2"] if case.get("fsdp2", True) else []):
            what = f"{arch} {name} ({system})"
            model = _train(rank, world, arch, system, case, expected, ref, what, mesh if case.get("tp") else None)
            if case.get("generate"):  # first: it must see the last step's values by itself
                _generate(model, system, ref, what)
            full = _full_values(model, system)
            for k, v in ref.state_dict().items():
                _close(full[k], v, f"{what}, {k} after training")
    return True
