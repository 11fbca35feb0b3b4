"""Workers of tests/distributed/test_hf_moe.py: a Hugging Face mixture-of-experts model
sharded with fully_shard (each transformer block, then the root) trains as one plain
process does on the whole batch, with experts that only some ranks route tokens to.

Hugging Face's MoE forwards loop over the experts some token was routed to (`for
expert_idx in expert_hit:`), so an expert no local token reached is not in that rank's
autograd graph. Where the experts are modules of their own (SwitchTransformers in
transformers 5.x: an nn.ModuleDict of `expert_i` MLPs), its parameters then get no local
gradient on that rank, while other ranks give them one: one process over the whole batch
gives them the mean over the ranks' slices, and so must every rank here, the ones holding
a piece of them without having used them included (Unit::agree_on_grads; before it such
a rank kept `.grad = None`, and AdamW skipped the piece: no update, no weight decay).
Mixtral (transformers 5.x) stores its experts fused as 3-D parameters (`gate_up_proj`,
`down_proj` of shape [experts, ...]): an expert no local token reached gets zero rows,
never a missing gradient; it is trained here as the common decoder-only case. (NLLB-MoE
has per-module experts too, but in transformers 5.23 its expert loop takes the values of
a one-hot mask for expert indices: only expert_0 and expert_1 ever run.)

Models: fp32, tiny, seed-identical on every rank and in the reference, no dropout, no
router jitter, expert capacity above the tokens per sequence (no token dropped), no
router auxiliary losses (output_router_logits=False: the load-balancing loss is not a
mean over tokens, so a whole-batch loss and the mean of the ranks' losses would differ).
The loss is the model's token-mean cross entropy: each rank's slice has the same number
of tokens (no padding), so the mean of the ranks' losses, which fully_shard's averaged
gradients follow, is the whole batch's loss of the reference.
"""
from __future__ import annotations

import collections
import copy
from typing import Dict, List

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp

from .workers import rel_err, shard_piece

VOCAB = 64
ROWS = 1  # sequences per rank: few tokens, so each rank reaches only some experts
SEQ = 6
TOL = 1e-5
# AdamW with weight decay (a None gradient skips the parameter: no update, no decay; a
# zero one decays it). eps=1e-3, not torch's 1e-8: Adam divides each gradient element by
# its own size, so elements that cancel to ~1e-7 (ReLU experts') would turn last-bit
# differences (~2% of them) into parameter differences; with 1e-8 the fp32 reference
# itself drifts from a float64 one by up to 3e-5 (gradients, step 3) at world 2, with
# 1e-3 by 3e-6, so TOL = 1e-5 holds for any correct sharded run.
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)


def build(arch: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "switch":
        cfg = transformers.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_heads=2, num_layers=2, num_decoder_layers=2,
            num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_experts=8, expert_capacity=64,
            router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, decoder_start_token_id=0)
        return transformers.SwitchTransformersForConditionalGeneration(cfg)
    assert arch == "mixtral", arch
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        router_jitter_noise=0.0, attention_dropout=0.0, output_router_logits=False, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(cfg)


def blocks(model: torch.nn.Module) -> List[torch.nn.Module]:
    if hasattr(model, "encoder"):  # SwitchTransformers: T5 blocks
        return list(model.encoder.block) + list(model.decoder.block)
    return list(model.model.layers)


def batch(step: int, world: int):
    """The global batch of a step: world * ROWS sequences (no pad or special tokens)."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(2, VOCAB, (world * ROWS, SEQ), generator=g),
            torch.randint(2, VOCAB, (world * ROWS, SEQ), generator=g))


def count_expert_hits(model: torch.nn.Module, hits: collections.Counter) -> int:
    """Forward hooks adding, per expert ("<moe block>/<expert index>"), the tokens routed to
    it in each forward: SwitchTransformers' expert modules count their calls' tokens,
    Mixtral's routers the tokens whose top-k holds the expert. Returns the number of
    experts (all MoE blocks)."""
    experts = 0
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind == "SwitchTransformersExperts":
            for key, expert in module.items():
                def hook(mod, args, out, key=f"{name}/{key.split('_')[-1]}"):
                    hits[key] += args[0].shape[0]
                expert.register_forward_hook(hook)
            experts += len(module)
        elif kind == "MixtralTopKRouter":
            def hook(mod, args, out, name=name):
                index = out[-1]  # (router logits, top-k weights, top-k expert indices)
                for e, n in zip(*torch.unique(index, return_counts=True)):
                    hits[f"{name}/{int(e)}"] += int(n)
            module.register_forward_hook(hook)
            experts += module.num_experts
    return experts


def _loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def _local_grad_is_none(arch: str, rank: int, world: int) -> Dict[str, bool]:
    """This rank's own, pre-reduction gradients of the first step: which parameters a plain
    copy of the model gets no gradient for from this rank's slice alone."""
    local = build(arch)
    ids, labels = batch(0, world)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    _loss(local, ids[rows], labels[rows]).backward()
    return {n: p.grad is None for n, p in local.named_parameters()}


def trains_like_one_process(rank: int, world: int, arch: str, steps: int = 3) -> Dict:
    """Trains build(arch) sharded (fully_shard per block, then the root; AdamW with weight
    decay) on this rank's rows of each step's batch, and the same model in plain PyTorch
    on the whole batch. Every step, before the optimizer: the losses agree, every
    parameter's gradient is None on every rank exactly where the reference's is, and
    otherwise its full tensor equals the reference's; after each step every full
    parameter equals the reference's. Checks that the first step has experts reached on
    some ranks only (and, for per-module experts, that those have no local gradient on a
    rank holding a piece of them). Returns the worst errors and that evidence."""
    ref = build(arch)
    model = copy.deepcopy(ref)
    for block in blocks(model):
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    hits = collections.Counter()
    experts = count_expert_hits(model, hits)
    ref_hits = collections.Counter()
    count_expert_hits(ref, ref_hits)

    local_none = _local_grad_is_none(arch, rank, world)
    pieces = {n: shard_piece(p)[2].numel for n, p in model.named_parameters()}

    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    evidence = {}
    for step in range(steps):
        ids, labels = batch(step, world)
        hits.clear()
        ref_hits.clear()
        loss = _loss(model, ids[rows], labels[rows])
        loss.backward()
        ref_loss = _loss(ref, ids, labels)
        ref_loss.backward()

        total = loss.detach().clone()
        dist.all_reduce(total)
        err = abs(total.item() / world - ref_loss.item()) / abs(ref_loss.item())
        assert err < TOL, f"step {step}: loss {total.item() / world} vs the reference's {ref_loss.item()}"
        worst["loss"] = max(worst["loss"], err)

        every_hits = [None] * world
        dist.all_gather_object(every_hits, dict(hits))
        assert sum(map(collections.Counter, every_hits), collections.Counter()) == ref_hits, (
            f"step {step}: the ranks' routing differs from the reference's")
        reached = set().union(*every_hits)
        partly = sorted(e for e in reached if any(e not in h for h in every_hits))
        if step == 0:
            # The case under test must occur: experts reached on some ranks only.
            assert partly, f"every expert reached is reached on every rank: {every_hits}"
            evidence["partly_reached_experts"] = partly
            evidence["experts"] = (experts, len(reached))  # (all, reached by some rank)

        flags = {n: p.grad is not None for n, p in model.named_parameters()}
        every_flags = [None] * world
        dist.all_gather_object(every_flags, flags)
        for name, p, q in zip(names, model.parameters(), ref.parameters()):
            lacking = [r for r in range(world) if not every_flags[r][name]]
            if q.grad is None:
                assert len(lacking) == world, (
                    f"step {step}: '{name}' has a gradient on ranks "
                    f"{sorted(set(range(world)) - set(lacking))}; the reference has none")
                continue
            assert not lacking, f"step {step}: '{name}' has no gradient on ranks {lacking}; the reference has one"
            got = p.grad.full_tensor()
            err = rel_err(got.reshape(-1), q.grad.reshape(-1))
            assert err < TOL, f"step {step}: gradient of '{name}' off by {err:.2e} (rank {rank})"
            worst["grad"] = max(worst["grad"], err)

        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        full = mfsdp.full_state_dict(model, rank0_only=False)
        for name, q in ref.named_parameters():
            err = rel_err(full[name], q)
            assert err < TOL, f"after step {step}: '{name}' off by {err:.2e} (rank {rank})"
            worst["param"] = max(worst["param"], err)

    # This rank's own gradients of step 0, before any reduction (a plain copy on its slice).
    every_local = [None] * world
    dist.all_gather_object(every_local, (local_none, pieces))
    lacked = []  # (rank, parameter, elements of it that rank holds): the case the agreement fixes
    for name in names:
        used_on = [r for r in range(world) if not every_local[r][0][name]]
        for r in range(world):
            if used_on and r not in used_on and every_local[r][1][name] > 0:
                lacked.append((r, name, every_local[r][1][name]))
    evidence["lacked_local_grad"] = lacked
    if arch == "switch":
        assert lacked, "no rank holds a piece of a parameter it got no local gradient for"
    return {"worst": worst, **evidence}
