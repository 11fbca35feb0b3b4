"""Workers for tests/distributed/test_hf_fp8.py: torchao's FP8 all-gather
(convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True)))
on a Hugging Face model: hf_feature_workers' tiny LlamaForCausalLM (hidden 32,
intermediate 64, 2 KV heads: every projection's dims divisible by 16, as torchao's FP8
matmuls want), its 14 decoder projections converted to Float8Linear (not the lm_head,
which is tied to the embedding), each decoder layer and the root sharded as FSDP2 users
do, bf16 parameters and fp32 reduction (fp8_workers' policy).

The reference is FSDP2 + torchao's own FP8 gather (its fsdp_pre/post_all_gather) run by
the same client code in the same processes: HF's `labels=` loss on left-padded rows with
an attention mask (hf_feature_workers.batch, `num_items_in_batch=`), AdamW, and
precompute_float8_dynamic_scale_for_fsdp after every optimizer step for both systems (as
torchtitan and Accelerate call it; on our units it finds nothing to do). Compared: each
rank's loss, every parameter's full gradient every step, every parameter after the steps.
The FP8 gather is in effect on our units (the layers gather their projection weights as
FP8 bytes, scale by scale torchao's) and on FSDP2's: every Float8Linear's forward sees a
Float8TrainingTensor weight."""
from __future__ import annotations

from typing import Dict

import torch

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .fp8_workers import _shard_fsdp2, amax_scale, bf16_policy, fp8_gathered, fp8_gathered_names
from .hf_feature_workers import ROWS, batch, build
from .tp_workers import full_of_ours, placements_of, worst_against_fsdp2

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _float8_llama():
    """hf_feature_workers' Llama (seed 0) with its decoder projections as Float8Linear
    whose weights ask for the FP8 all-gather."""
    from torchao.float8.float8_linear import Float8Linear

    model = fp8_gathered(build("llama"), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == len(PROJECTIONS) * len(model.model.layers), converted
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    return model


def _shard_ours(model):
    mp = bf16_policy("ours")
    for layer in model.model.layers:
        mfsdp.fully_shard(layer, mp_policy=mp)
    return mfsdp.fully_shard(model, mp_policy=mp)


def _units(model):
    """(name prefix, unit) of each fully_shard unit of ours: the layers, then the root."""
    layers = [(f"model.layers.{i}.", layer) for i, layer in enumerate(model.model.layers)]
    return [(prefix, m._fsdp_state.unit) for prefix, m in layers + [("", model)]]


def _assert_fp8_units(model) -> None:
    """Each decoder layer's unit gathers its 7 projection weights as FP8 bytes and the
    rest (norms) in bf16; the root (tied embedding, final norm) gathers bf16 only."""
    assert len([s for s in iter_states(model) if s.unit is not None]) == 3
    for prefix, unit in _units(model):
        fp8 = fp8_gathered_names(unit)
        want = sorted(f"{p}.weight" for p in PROJECTIONS) if prefix else []
        assert fp8 == want, (prefix, fp8)
        assert bool(unit.gathers_bytes) == bool(want), (prefix, unit.gathers_bytes)


def _assert_torchaos_scales(model, what: str) -> None:
    """Each FP8 weight's scale in our units is torchao's for its full fp32 master."""
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for prefix, unit in _units(model):
        for i, spec in enumerate(unit.param_specs):
            if "FP8" in str(spec.transform):
                want = amax_scale(full[prefix + spec.name])
                assert torch.equal(unit.fp8_scales[i].cpu(), want), \
                    f"{what}: scale of {prefix + spec.name} {unit.fp8_scales[i].item()} vs torchao's {want.item()}"


def hf_fp8_gather_vs_fsdp2(rank: int, world: int, steps: int = 3) -> Dict:
    """The same loop under ours and under FSDP2, each with torchao's FP8 all-gather:
    each rank's loss, every full gradient every step and every value after, bit for bit
    (asserted here; returns the largest gradient and value errors, 0, and how far the
    parameters moved)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    models = {"ours": _shard_ours(_float8_llama())}
    placements = placements_of(models["ours"])
    fsdp2 = _float8_llama()
    models["fsdp2"] = _shard_fsdp2(fsdp2, list(fsdp2.model.layers))
    _assert_fp8_units(models["ours"])
    seen = {k: [] for k in models}
    for k, m in models.items():
        for lin in (x for x in m.modules() if isinstance(x, Float8Linear)):
            lin.register_forward_pre_hook(lambda mod, args, k=k: seen[k].append(type(mod.weight)))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    per = ROWS // world
    rows = slice(rank * per, (rank + 1) * per)
    worst = {"grad": 0.0}
    for step in range(steps):
        ids, mask, labels = batch(step)
        tokens = (labels[:, 1:] != -100).sum()
        losses = {}
        for k, m in models.items():
            loss = m(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows],
                     num_items_in_batch=tokens / world).loss
            loss.backward()
            losses[k] = loss.item()
        if step == 0:
            _assert_torchaos_scales(models["ours"], "first forward")
        assert losses["ours"] == losses["fsdp2"], f"step {step}: loss {losses['ours']} vs FSDP2's {losses['fsdp2']}"
        worst["grad"] = max(worst["grad"], worst_against_fsdp2(models["ours"], models["fsdp2"], "grad", placements,
                                                               None, 0.0, f"step {step}"))
        for k, m in models.items():
            opts[k].step()
            opts[k].zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(m)
    worst["value"] = worst_against_fsdp2(models["ours"], models["fsdp2"], "value", placements, None, 0.0,
                                         "after the steps")
    _assert_torchaos_scales(models["ours"], f"after {steps} steps")
    calls = len(PROJECTIONS) * len(models["ours"].model.layers) * steps
    for k in models:
        assert len(seen[k]) == calls and all(t is Float8TrainingTensor for t in seen[k]), \
            (k, len(seen[k]), set(seen[k]))
    final = full_of_ours(models["ours"], "value", placements)
    start = build("llama").state_dict()  # the same seed, plain
    worst["moved"] = max((v - start[name].double()).abs().max().item() for name, v in final.items())
    return worst
