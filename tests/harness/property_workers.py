"""Workers of tests/distributed/test_property.py: seeded random cases (issue 41 item 2).

Each case is generated from one integer seed, identically on every rank: a small random
module graph (sequential blocks, a block called twice, a block called on an input that
needs no gradient, a block called under torch.no_grad(), list units, nested units, a
tied embedding/head, frozen and unused parameters, blocks returning tuples, dicts and
dataclasses, dims not divisible by the world), one way to shard and train it (strategy,
or one per unit; mixed precision; CPU offload and its optimizers; buckets; prefetch;
gradient accumulation; clipping) and random writes to the parameters between steps.
The sharded model trains against one plain process on the same data (the whole batch),
step by step: each rank's loss, the full gradient of every parameter, and every parameter
after the steps. FP8 all-gather cases (torchao) train against FSDP2 + torchao instead
(fp8 family below). Findings become fixed cases at the end (their own tests).

A case fails with its seed and the command that reruns it alone (MFSDP_PROPERTY_SEED)."""
from __future__ import annotations

import dataclasses
import os
import random
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

from .workers import rel_err

SEED_ENV = "MFSDP_PROPERTY_SEED"
CASE_TIMEOUT_S = 120  # one case takes 0.1 to 2 s; far beyond that it hangs
RERUN = f"{SEED_ENV}={{seed}} python -m pytest tests/distributed/test_property.py -k train_like"

STRATEGIES = ["optim_grads_params", "optim_grads", "optim", "no_shard"]
OFFLOAD_STRATEGIES = ["optim_grads_params", "optim_grads"]  # what CPUOffloadPolicy accepts
WRITE_OPS = ["clamp", "no_grad_mul", "zero", "replace_data", "replace_param", "ema", "toggle_requires_grad"]
# How a block is called in the model's forward (its role, fixed for the case).
ROLES = ["normal", "twice", "raw_first", "no_grad_side", "no_grad_then_grad", "skippable"]
OUTPUT_KINDS = ["tensor", "tuple", "dict", "dataclass"]

# The bound on every relative error (losses, gradients, parameters, clip norms). fp32: only
# the order of fp32 sums differs from the reference (measured <= 3e-6 for gradients, 1e-6
# for parameters). bf16: the reference computes each rank's rows in bf16 as the units do
# and reduces as they do, so losses and gradients come out bit for bit equal (measured
# 0.0) as long as the fp32 masters do: what could move a master by an fp32 ulp, and so a
# bf16 cast by a bf16 ulp (~1e-4 in a loss), is aligned (the clip coefficient comes from
# our norm, CPUAdamW steps both). A kept copy left stale by a write was off by 2e-4 to
# 6e-2 (the library before 375907f), so no looser bound for bf16.
TOL = 1e-5


def case_seeds(count: int) -> List[int]:
    """The suite's seeds: `count` from 0 (MFSDP_PROPERTY_CASES and MFSDP_PROPERTY_FIRST
    change them, for longer or other runs), or the one MFSDP_PROPERTY_SEED names."""
    one = os.environ.get(SEED_ENV)
    if one:
        return [int(one)]
    first = int(os.environ.get("MFSDP_PROPERTY_FIRST", "0"))
    return list(range(first, first + int(os.environ.get("MFSDP_PROPERTY_CASES", str(count)))))


# ----------------------------------------------------------------------------- the case
@dataclasses.dataclass
class BlockSpec:
    hidden: int
    role: str
    output: str
    frozen: str  # "", "fc1.weight" or "all"
    unused: bool  # a Linear never called
    branch: bool  # `alt`, used only in the steps whose plan says so
    nested: bool  # an inner block of its own (a unit inside this block's unit)


@dataclasses.dataclass
class Case:
    seed: int
    world: int
    family: str  # "plain" (against one process) or "fp8" (against FSDP2 + torchao)
    width: int
    tokens: bool  # embedding input (vocab) instead of features
    vocab: int
    tied: bool
    blocks: List[BlockSpec]
    units: List[List[int]]  # groups of block indices, each one fully_shard call (a list unit if > 1)
    nested_units: List[int]  # blocks whose inner block is a unit of its own
    embed_head_unit: bool  # fully_shard([embed, head]) (tied or not)
    strategy: str
    reshard_after_forward: List[bool]  # per fully_shard call, in order (optim_grads_params only)
    mp: str  # "fp32", "bf16" (fp32 reduction) or "bf16_reduce_bf16"
    offload: str  # "", "all" or "blocks" (partial: the root stays on the device)
    optimizer: str  # "sgd", "adamw", "cpu_adamw", "cpu_adamw_overlap"
    gather_bucket_bytes: int
    reduce_bucket_bytes: int
    prefetch_depth: int
    steps: int
    rows: int
    plans: List[Dict]  # per step (and one more for the last check): skipped blocks, branch flags
    writes: List[List[Dict]]  # per step, after the optimizer: the writes
    eval_between_steps: bool
    micro_batches: int  # backward passes a step accumulates
    sync: str  # "every" micro-batch reduces, or only the "last" (set_requires_gradient_sync)
    clip: Optional[float]  # clip_grad_norm_ to this before each optimizer step
    unit_strategies: Optional[List[str]]  # per fully_shard call, in order; None: `strategy` for all

    def kind(self) -> str:
        """The group the worst errors are reported by (family, precision, world)."""
        return f"{self.family}/{self.mp}/world{self.world}"

    def summary(self) -> str:
        roles = ",".join(f"{b.role}/{b.output}" + ("/nested" if b.nested else "") + ("/frozen:" + b.frozen
                         if b.frozen else "") + ("/unused" if b.unused else "") + ("/branch" if b.branch else "")
                         for b in self.blocks)
        writes = sorted({w["op"] for step in self.writes for w in step})
        return (f"world={self.world} family={self.family} strategy={self.strategy} mp={self.mp} "
                f"offload={self.offload or '-'} optimizer={self.optimizer} width={self.width} tokens={self.tokens} "
                f"tied={self.tied} units={self.units} nested={self.nested_units} "
                f"embed_head_unit={self.embed_head_unit} "
                f"rafw={''.join('TF'[not r] for r in self.reshard_after_forward[:8])} "
                f"buckets=({self.gather_bucket_bytes},{self.reduce_bucket_bytes}) prefetch={self.prefetch_depth} "
                f"steps={self.steps} blocks=[{roles}] writes={writes} eval={self.eval_between_steps} "
                f"micro_batches={self.micro_batches} sync={self.sync} clip={self.clip} "
                f"unit_strategies={self.unit_strategies}")


def family_of(seed: int) -> str:
    """About one case in twenty is an FP8 all-gather case (against FSDP2 + torchao)."""
    return "fp8" if random.Random(seed * 7919 + 2).random() < 0.05 else "plain"


def world_of(seed: int) -> int:
    """About one case in ten runs at world 4, the rest (FP8 cases all) at world 2."""
    if family_of(seed) == "fp8":
        return 2
    return 4 if random.Random(seed * 7919 + 1).random() < 0.1 else 2


def make_case(seed: int):
    """The case of `seed`: the same on every rank and in every run."""
    if family_of(seed) == "fp8":
        return make_fp8_case(seed)
    rng = random.Random(seed)
    world = world_of(seed)
    width = rng.choice([5, 6, 7, 9, 11, 13, 16])  # mostly not divisible by the world
    n_blocks = rng.randint(1, 4)
    blocks = []
    for _ in range(n_blocks):
        blocks.append(BlockSpec(
            hidden=rng.choice([3, 5, 8, 10, 12, 15]),
            role=rng.choice(ROLES),
            output=rng.choice(OUTPUT_KINDS),
            frozen=rng.choice(["", "", "", "fc1.weight", "all"]),
            unused=rng.random() < 0.2,
            branch=rng.random() < 0.25,
            nested=rng.random() < 0.2,
        ))
    tokens = rng.random() < 0.4
    tied = tokens and rng.random() < 0.6
    # Units: each block its own unit, or joined with its neighbour into one list unit, or
    # left to the root.
    units, i = [], 0
    while i < n_blocks:
        r = rng.random()
        if r < 0.25 and i + 1 < n_blocks:
            units.append([i, i + 1])
            i += 2
        elif r < 0.8:
            units.append([i])
            i += 1
        else:
            i += 1
    nested_units = [i for i, b in enumerate(blocks) if b.nested and rng.random() < 0.8]
    strategy = rng.choice(STRATEGIES)
    # A bf16 reduction only at world 2: there a + b rounds alike in either order, so the
    # reference's sum is the backend's bit for bit; at world 4 Gloo's order of the four
    # bf16 addends is its own (an ulp apart, amplified by the optimizer).
    mp = rng.choice(["fp32", "fp32", "bf16", "bf16_reduce_bf16" if world == 2 else "bf16"])
    offload = ""
    if strategy in OFFLOAD_STRATEGIES and rng.random() < 0.35:
        offload = rng.choice(["all", "all", "blocks"])
    if offload:
        optimizer = rng.choice(["adamw", "cpu_adamw", "cpu_adamw_overlap"])
    else:
        optimizer = rng.choice(["sgd", "adamw"])
    embed_head_unit = tokens and rng.random() < 0.5
    rafw = [rng.random() < 0.75 for _ in range(16)]  # per fully_shard call, in order
    steps = rng.choice([2, 3])
    plans = []
    for _ in range(steps + 1):
        plans.append({
            "skip": [b.role == "skippable" and rng.random() < 0.5 for b in blocks],
            "alt": [b.branch and rng.random() < 0.5 for b in blocks],
        })
    writes = []
    for _ in range(steps):
        step_writes = []
        if rng.random() < 0.7:
            for _ in range(rng.randint(1, 3)):
                # `pick`: which of named_parameters() (resolved by apply_writes)
                step_writes.append({"op": rng.choice(WRITE_OPS), "pick": rng.random(),
                                    "seed": rng.randrange(1 << 30)})
        writes.append(step_writes)
    return Case(
        seed=seed, world=world, family="plain", width=width, tokens=tokens, vocab=rng.choice([7, 10, 13]),
        tied=tied, blocks=blocks, units=units, nested_units=nested_units,
        embed_head_unit=embed_head_unit, strategy=strategy, reshard_after_forward=rafw, mp=mp, offload=offload,
        optimizer=optimizer,
        gather_bucket_bytes=rng.choice([0, 0, rng.randint(64, 1024), 1 << 20]),
        reduce_bucket_bytes=rng.choice([0, 0, rng.randint(64, 1024), 1 << 20]),
        prefetch_depth=rng.choice([0, 1, 1, 2]), steps=steps, rows=rng.choice([2, 3]), plans=plans,
        writes=writes, eval_between_steps=rng.random() < 0.3, **_accumulation_and_clipping(seed, mp),
        unit_strategies=_mixed_strategies(seed, len(nested_units) + len(units) + embed_head_unit, offload),
    )


def _mixed_strategies(seed: int, root_call: int, offload: str) -> Optional[List[str]]:
    """One case in five gives each fully_shard call a strategy of its own (a stream of its
    own, as above); offloaded units only those CPUOffloadPolicy accepts."""
    rng = random.Random(seed * 7919 + 4)
    if rng.random() >= 0.2:
        return None
    out = []
    for call in range(root_call + 1):
        offloaded = offload == "all" or (offload == "blocks" and call != root_call)
        out.append(rng.choice(OFFLOAD_STRATEGIES if offloaded else STRATEGIES))
    return out


def _accumulation_and_clipping(seed: int, mp: str) -> Dict:
    """Drawn from a stream of their own, so that adding them kept every earlier draw of a
    seed. Accumulation without a reduction per micro-batch in fp32 only: how a unit sums
    unreduced bf16 gradients across backward passes is its own choice, not the policy's."""
    rng = random.Random(seed * 7919 + 3)
    micro = 2 if rng.random() < 0.25 else 1
    sync = "every" if micro == 1 or mp != "fp32" else rng.choice(["every", "last"])
    return {"micro_batches": micro, "sync": sync, "clip": rng.choice([None, None, None, 0.05, 0.5])}


def features_of(case) -> List[str]:
    """What a case exercises, as names the coverage test counts."""
    if case.family == "fp8":
        out = ["fp8", f"fp8/strategy:{case.strategy}", "fp8/writes" if any(case.writes) else "fp8/no_writes"]
        out += [f"fp8/write:{w['op']}" for step in case.writes for w in step]
        return out
    out = [f"world:{case.world}", f"strategy:{case.strategy}", f"mp:{case.mp}", f"{case.strategy}+{case.mp}",
           f"optimizer:{case.optimizer}", f"prefetch:{case.prefetch_depth}"]
    if case.offload:
        out += [f"offload:{case.offload}", f"offload+{case.optimizer}", f"offload+{case.mp}"]
    for what, nbytes in (("gather", case.gather_bucket_bytes), ("reduce", case.reduce_bucket_bytes)):
        out.append(f"{what}_bucket:" + ("0" if nbytes == 0 else "small" if nbytes < 4096 else "large"))
    out += [f"role:{b.role}" for b in case.blocks] + [f"output:{b.output}" for b in case.blocks]
    out += [f"frozen:{b.frozen}" for b in case.blocks if b.frozen]
    out += ["unused_param" for b in case.blocks if b.unused] + ["branch" for b in case.blocks if b.branch]
    out += ["list_unit" for u in case.units if len(u) > 1] + ["nested_unit"] * bool(case.nested_units)
    out += ["tokens"] * case.tokens + ["tied"] * case.tied + ["embed_head_unit"] * case.embed_head_unit
    out += ["uneven_width"] * (case.width % case.world != 0) + ["eval_between_steps"] * case.eval_between_steps
    out += [f"write:{w['op']}" for step in case.writes for w in step]
    out += [f"write:{w['op']}+{case.strategy}+{case.mp}" for step in case.writes for w in step]
    if case.micro_batches > 1:
        out += [f"accumulate:sync_{case.sync}", f"accumulate:sync_{case.sync}+{case.strategy}"]
    out += ["clip"] * (case.clip is not None) + ["mixed_strategies"] * (case.unit_strategies is not None)
    if case.strategy == "optim_grads_params":
        out += ["reshard_after_forward:mixed"] * (len(set(case.reshard_after_forward[:3])) > 1)
    return out


# ---------------------------------------------------------------------------- the model
@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    aux: torch.Tensor


class InnerBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    """A residual MLP block; what it returns and which of its parameters it uses vary."""

    def __init__(self, d: int, spec: BlockSpec):
        super().__init__()
        self.output = spec.output
        self.fc1 = nn.Linear(d, spec.hidden)
        self.fc2 = nn.Linear(spec.hidden, d)
        self.alt = nn.Linear(spec.hidden, d) if spec.branch else None
        self.unused = nn.Linear(d, 3) if spec.unused else None
        self.inner = InnerBlock(d, spec.hidden) if spec.nested else None
        if spec.frozen == "all":
            self.requires_grad_(False)
        elif spec.frozen:
            self.get_parameter(spec.frozen).requires_grad_(False)

    def forward(self, x, use_alt: bool = False):
        if self.inner is not None:
            x = self.inner(x)
        z = torch.tanh(self.fc1(x))
        out = self.fc2(z)
        if use_alt:
            out = out + self.alt(z)
        hidden, aux = x + out, z.pow(2).mean()
        if self.output == "tuple":
            return hidden, aux
        if self.output == "dict":
            return {"hidden": hidden, "aux": aux}
        if self.output == "dataclass":
            return BlockOutput(hidden, aux)
        return hidden


def _unpack(out):
    """(hidden, aux or None) from any of Block's output kinds."""
    if isinstance(out, tuple):
        return out
    if isinstance(out, dict):
        return out["hidden"], out["aux"]
    if isinstance(out, BlockOutput):
        return out.hidden, out.aux
    return out, None


class PropertyNet(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        d = case.width
        self.roles = [b.role for b in case.blocks]
        if case.tokens:
            self.embed = nn.Embedding(case.vocab, d)
        else:
            self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, b) for b in case.blocks)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():  # LayerNorm starts at ones/zeros: values that differ tell more apart
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)
        out = case.vocab if case.tokens else 4
        self.head = nn.Linear(d, out, bias=not case.tokens)
        if case.tied:
            self.head.weight = self.embed.weight

    def forward(self, x, plan: Dict):
        if hasattr(self, "embed"):
            h = self.embed(x)
            raw = h.detach()  # an input that needs no gradient
        else:
            h = self.inp(x)
            raw = x
        aux = []

        def call(i, inp):
            hidden, a = _unpack(self.blocks[i](inp, use_alt=plan["alt"][i]))
            if a is not None:
                aux.append(a)
            return hidden

        for i, role in enumerate(self.roles):
            if role == "normal" or (role == "skippable" and not plan["skip"][i]):
                h = call(i, h)
            elif role == "twice":
                h = call(i, call(i, h))
            elif role == "raw_first":  # the first call's backward runs after the second's
                r = call(i, raw)
                h = call(i, h + 0.5 * r)
            elif role == "no_grad_side":
                with torch.no_grad():
                    t = call(i, h)
                h = h + 0.3 * t
            elif role == "no_grad_then_grad":
                with torch.no_grad():
                    t = call(i, h)
                h = call(i, h) + 0.3 * t
        logits = self.head(self.norm(h))
        return logits, (sum(a.float() for a in aux) if aux else None)


def build_plain(case: Case) -> PropertyNet:
    torch.manual_seed(case.seed)
    return PropertyNet(case)


def shard_model(model: PropertyNet, case: Case) -> PropertyNet:
    """The case's fully_shard calls, bottom-up: nested inner blocks, block units (list
    units for groups), the embedding and head, the root."""
    mp = {"fp32": mfsdp.MixedPrecisionPolicy(),
          "bf16": mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          "bf16_reduce_bf16": mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                         reduce_dtype=torch.bfloat16)}[case.mp]
    offload = CPUOffloadPolicy() if case.offload else None
    rafw = iter(case.reshard_after_forward)
    strategies = iter(case.unit_strategies or [case.strategy] * 16)

    def shard(target, root=False, **kw):
        strategy = next(strategies)
        keep = strategy != "optim_grads_params"
        mfsdp.fully_shard(target, sharding_strategy=strategy, mp_policy=mp,
                          reshard_after_forward=False if keep else next(rafw),
                          offload_policy=None if (root and case.offload == "blocks") else offload, **kw)

    for i in case.nested_units:
        shard(model.blocks[i].inner)
    for group in case.units:
        members = [model.blocks[i] for i in group]
        shard(members if len(members) > 1 else members[0])
    if case.embed_head_unit:
        shard([model.embed, model.head])
    shard(model, root=True, gather_bucket_bytes=case.gather_bucket_bytes,
          reduce_bucket_bytes=case.reduce_bucket_bytes, prefetch_depth=case.prefetch_depth)
    return model


# --------------------------------------------------------------------------- the steps
def batch_of(case: Case, step: int, micro: int = 0):
    """Every rank's rows of micro-batch `micro` of step `step` (inputs, targets), the same
    on every rank."""
    g = torch.Generator().manual_seed(case.seed * 1000 + step * 10 + micro)
    n = case.world * case.rows
    if case.tokens:
        x = torch.randint(0, case.vocab, (n, 3), generator=g)
        y = torch.randint(0, case.vocab, (n, 3), generator=g)
    else:
        x = torch.randn(n, case.width, generator=g)
        y = torch.randn(n, 4, generator=g)
    return x, y


def loss_of(model, case: Case, x, y, plan, cast=None):
    """The mean loss over these rows; `cast`: the dtype floating inputs get (what a unit's
    mixed-precision policy does to the root's inputs)."""
    if cast is not None and x.is_floating_point():
        x = x.to(cast)
    logits, aux = model(x, plan)
    if case.tokens:
        loss = F.cross_entropy(logits.float().reshape(-1, case.vocab), y.reshape(-1))
    else:
        loss = F.mse_loss(logits.float(), y)
    return loss + 0.1 * aux if aux is not None else loss


def make_optimizer(params, kind: str):
    # AdamW's eps bounds how much it amplifies float-rounding differences of near-zero
    # gradients (the reduction order differs from the reference's).
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
    from megatron_fsdp_ext.optim import CPUAdamW
    return CPUAdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1, overlap_step=kind == "cpu_adamw_overlap")


def reference_optimizer(case: Case) -> str:
    """torch's optimizer, whose results CPUAdamW's equal up to float rounding: fp32 cases
    check that. bf16 cases step with CPUAdamW too when ours does: a master one fp32 ulp
    apart can round to another bf16 value (an error of ~1e-4 in a loss), and the bf16
    reference is otherwise exact."""
    if case.optimizer.startswith("cpu_adamw"):
        return "cpu_adamw" if case.mp != "fp32" else "adamw"
    return case.optimizer


class PlainReference:
    """The plain model (fp32 master weights) and its optimizer. fp32 cases: the whole
    batch through the model, its loss backward. bf16 cases: each rank's rows through a bf16 copy of the model, their
    gradients reduced as the units' policy does (summed in the reduce dtype, divided by
    the world) into the fp32 masters."""

    def __init__(self, case: Case):
        self.case = case
        self.model = build_plain(case)
        self.opt = make_optimizer(self.model.parameters(), reference_optimizer(case))
        # bf16: the compute copy, refreshed from the masters before each use (as a cast
        # gather does); built once, a deepcopy per step costs more than the step.
        self.shadow = build_plain(case).to(torch.bfloat16) if case.mp != "fp32" else None

    def _bf16_copy(self) -> nn.Module:
        with torch.no_grad():
            for s, m in zip(self.shadow.parameters(), self.model.parameters()):
                s.copy_(m)
                s.requires_grad_(m.requires_grad)
        return self.shadow

    def forward_backward(self, step_plan, batches) -> List[float]:
        """The step's gradients into the masters, from its micro-batches (x, y); returns
        each rank's loss (summed over the micro-batches, each divided by their number)."""
        case, world, micro = self.case, self.case.world, len(batches)
        self.opt.zero_grad(set_to_none=True)
        losses = [0.0] * world
        for x, y in batches:
            if case.mp == "fp32":
                # Every term of the loss is a mean over rows and the ranks hold as many
                # rows each: the whole batch's loss is the mean of the ranks'.
                loss = loss_of(self.model, case, x, y, step_plan) / micro
                if loss.requires_grad:
                    loss.backward()
                rank_losses = self.eval_losses(step_plan, x, y)
            else:
                rank_losses = self._bf16_backward(step_plan, x, y, micro)
            losses = [a + b / micro for a, b in zip(losses, rank_losses)]
        return losses

    def _bf16_backward(self, step_plan, x, y, micro: int) -> List[float]:
        """One micro-batch: each rank's rows in bf16, their gradients reduced in the reduce
        dtype (summed, divided by the world) and added to the masters' (fp32)."""
        case, world, rows = self.case, self.case.world, self.case.rows
        shadow = self._bf16_copy()
        params = dict(shadow.named_parameters())
        per_rank, losses = [], []
        for r in range(world):
            loss = loss_of(shadow, case, x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows], step_plan,
                           cast=torch.bfloat16)
            if loss.requires_grad:
                (loss / micro).backward()
            losses.append(loss.item())
            per_rank.append({n: (p.grad.clone() if p.grad is not None else None) for n, p in params.items()})
            shadow.zero_grad(set_to_none=True)
        reduce_dtype = torch.bfloat16 if case.mp == "bf16_reduce_bf16" else torch.float32
        for name, p in self.model.named_parameters():
            grads = [g[name] for g in per_rank if g[name] is not None]
            if not grads:
                continue
            total = grads[0].to(reduce_dtype)
            for g in grads[1:]:
                total = total + g.to(reduce_dtype)
            reduced = total.float() / world
            p.grad = reduced if p.grad is None else p.grad + reduced
        return losses

    def eval_losses(self, step_plan, x, y) -> List[float]:
        """Each rank's loss, without gradients."""
        case, rows = self.case, self.case.rows
        model = self.model if case.mp == "fp32" else self._bf16_copy()
        cast = None if case.mp == "fp32" else torch.bfloat16
        with torch.no_grad():
            return [loss_of(model, case, x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows], step_plan,
                            cast=cast).item() for r in range(case.world)]


def shard_names(model: nn.Module) -> Dict[int, str]:
    """id() of every sharded parameter to its name, read right after fully_shard: a
    module slot may later hold a user's replacement until its unit adopts it."""
    return {id(p): n for n, p in model.named_parameters()}


def full_grads(model: nn.Module, names: Dict[int, str]) -> Dict[str, Optional[torch.Tensor]]:
    """Every parameter's full gradient (one collective per unit): by name; None where the
    ranks holding it have none."""
    states = [s for s in iter_states(model) if s.unit is not None]
    params = [p for s in states for p in s.sharded_params]
    # A rank whose shard of a parameter is empty cannot tell whether it has a gradient:
    # count, over the ranks holding elements of it, those whose shard has one.
    counts = torch.tensor([[int(p.numel() > 0), int(p.numel() > 0 and p.grad is not None)] for p in params],
                          dtype=torch.int64).reshape(-1, 2)
    dist.all_reduce(counts)
    out: Dict[str, Optional[torch.Tensor]] = {}
    k = 0
    for state in states:
        pieces = [p.grad.detach() if p.grad is not None else None for p in state.sharded_params]
        full = state.unit.gather_full(pieces, torch.float32)
        for p, f in zip(state.sharded_params, full):
            holders, with_grad = counts[k].tolist()
            k += 1
            if with_grad not in (0, holders):
                raise CaseFailure(f"gradient of '{names.get(id(p))}' set on {with_grad} of the {holders} ranks "
                                  "holding elements of it")
            if id(p) in names:
                out[names[id(p)]] = f if with_grad else None
    return out


def _shard_slice(p):
    """(offset, numel) of this rank's piece of the sharded parameter p in its full flat
    value; None for a parameter of no unit (a replacement not yet adopted)."""
    owner = getattr(p, "_mfsdp_owner", None)
    state = owner() if owner is not None else None
    index = next((i for i, q in enumerate(state.sharded_params) if q is p), None) if state is not None else None
    if index is None:
        return None
    piece = state.unit.layout.shard_slices(state.unit.shard_index)[index]
    return piece.param_offset, piece.numel


def _write(op: str, p: torch.Tensor, new: torch.Tensor, bound: float) -> None:
    """One write by its own API on the tensor a script holds (`new`: its new value)."""
    if op == "clamp":
        p.data.clamp_(-bound, bound)
    elif op == "no_grad_mul":
        with torch.no_grad():
            p.mul_(0.5)
    elif op == "zero":
        p.data.zero_()
    elif op == "replace_data":
        p.data = new.to(p.dtype)
    elif op == "ema":
        p.data.mul_(0.9).add_(0.1 * new.to(p.dtype))
    elif op == "toggle_requires_grad":  # freeze or unfreeze between steps
        p.requires_grad_(not p.requires_grad)
    else:
        raise ValueError(op)


def replacement_requires_grad(write: Dict, current: torch.Tensor) -> bool:
    """`module.weight = nn.Parameter(full, requires_grad=...)`: mostly the flag the
    parameter has, one time in four the other (a replacement freezes or unfreezes)."""
    return current.requires_grad != (random.Random(write["seed"]).random() < 0.25)


def apply_writes(writes: List[Dict], model: nn.Module, plain: nn.Module) -> None:
    """The step's writes, each by its own API, on the plain model (full values) and on
    our sharded model (the same op on this rank's shard; the full value where the API
    takes one: `module.weight = nn.Parameter(full)`)."""
    plain_params = dict(plain.named_parameters())
    names = list(plain_params)
    tied = {n for n, _ in plain.named_parameters(remove_duplicate=False)} - set(names)
    for w in writes:
        op, name = w["op"], w.get("name") or names[int(w["pick"] * len(names))]  # a name: reproducers
        if op == "replace_param" and tied and name == "embed.weight":
            op = "replace_data"  # assigning one slot of a tied pair unties it in plain PyTorch
        full = plain_params[name]
        new_full = torch.randn(full.shape, generator=torch.Generator().manual_seed(w["seed"])) * 0.3
        bound = 0.5 * full.detach().abs().max().item()  # clamp: from the plain model, the same on every rank
        ours = model.get_parameter(name)  # what the module holds: a shard, or a replacement not yet adopted
        if op == "replace_param":
            module_name, _, attr = name.rpartition(".")
            requires_grad = replacement_requires_grad(w, full)
            # Ours take the full value and keep their slice; plain: the same values and
            # flag into the object its optimizer holds.
            setattr(model.get_submodule(module_name), attr,
                    nn.Parameter(new_full.clone(), requires_grad=requires_grad))
            full.data = new_full.clone()
            full.requires_grad_(requires_grad)
            continue
        piece = _shard_slice(ours)
        new = new_full.reshape(-1)[piece[0]:piece[0] + piece[1]].clone() if piece is not None else new_full.clone()
        _write(op, ours, new, bound)
        _write(op, full, new_full.clone(), bound)


class CaseFailure(AssertionError):
    """A case's sharded model trained otherwise than its reference."""


def compare_losses(when: str, ours: float, theirs: List[float], rank: int) -> float:
    want = theirs[rank]
    err = abs(ours - want) / max(abs(want), 1e-6)
    if not err <= TOL:
        raise CaseFailure(f"{when}: loss on rank {rank} {ours!r} vs the plain model's {want!r} (rel err {err:.2e})")
    return err


def compare_grads(when: str, model, names: Dict[int, str], plain) -> float:
    ours = full_grads(model, names)
    worst = 0.0
    for name, p in plain.named_parameters():
        got, want = ours[name], p.grad
        if want is None or got is None:
            if (want is None) != (got is None):
                raise CaseFailure(f"{when}: gradient of '{name}' is {'None' if got is None else 'set'}, the plain "
                                  f"model's is {'None' if want is None else 'set'}")
            continue
        err = rel_err(got.reshape(want.shape), want)
        if not err <= TOL:
            raise CaseFailure(f"{when}: gradient of '{name}' rel err {err:.3e} (norm {got.norm():.4e} vs "
                              f"{want.norm():.4e})")
        worst = max(worst, err)
    return worst


def compare_params(when: str, model, plain) -> float:
    full = mfsdp.full_state_dict(model, rank0_only=False)
    want = plain.state_dict()
    if set(full) != set(want):
        raise CaseFailure(f"{when}: state dict keys differ: {sorted(set(full) ^ set(want))}")
    worst = 0.0
    for k, v in want.items():
        err = rel_err(full[k], v)
        if not err <= TOL:
            raise CaseFailure(f"{when}: parameter '{k}' rel err {err:.3e}")
        worst = max(worst, err)
    return worst


def run_case(case: Case, rank: int) -> Dict:
    """Train the case's sharded model and the plain reference side by side."""
    ref = PlainReference(case)
    model = shard_model(build_plain(case), case)  # the same seed: the same values
    names = shard_names(model)
    opt = make_optimizer(model.parameters(), case.optimizer)
    rows = slice(rank * case.rows, (rank + 1) * case.rows)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def step_and_compare(step: int, plan: Dict, when: str) -> None:
        batches = [batch_of(case, step, m) for m in range(case.micro_batches)]
        theirs = ref.forward_backward(plan, batches)
        opt.zero_grad(set_to_none=True)
        local = 0.0
        for m, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(case.sync == "every" or m == len(batches) - 1)
            loss = loss_of(model, case, x[rows], y[rows], plan) / len(batches)
            if loss.requires_grad:
                loss.backward()
            local += loss.item()
        worst["loss"] = max(worst["loss"], compare_losses(when, local, theirs, rank))
        worst["grad"] = max(worst["grad"], compare_grads(when, model, names, ref.model))
        if case.clip is not None and step < case.steps:
            ours = mfsdp.clip_grad_norm_(model, case.clip)
            params = [p for p in ref.model.parameters() if p.grad is not None]
            theirs = torch.nn.utils.get_total_norm([p.grad for p in params])
            err = abs(ours.item() - theirs.item()) / max(theirs.item(), 1e-12)
            if not err <= TOL:
                raise CaseFailure(f"{when}: clip_grad_norm_ returned {ours.item()!r}, the plain model's "
                                  f"{theirs.item()!r}")
            worst["grad"] = max(worst["grad"], err)
            # bf16: scaled by the coefficient of our norm, the masters stay bit for bit
            # ours (the norms' sums run in other orders: an fp32 ulp moves a bf16 cast).
            norm = theirs if case.mp == "fp32" else ours.detach().to(theirs.dtype)
            torch.nn.utils.clip_grads_with_norm_(params, case.clip, norm)

    for step in range(case.steps):
        step_and_compare(step, case.plans[step], f"step {step}")
        opt.step()
        ref.opt.step()
        if case.optimizer == "cpu_adamw_overlap":  # its contract: synchronize() before touching the shards
            opt.synchronize()
        apply_writes(case.writes[step], model, ref.model)
        if case.eval_between_steps:
            x, y = batch_of(case, 100 + step)
            with torch.no_grad():
                ours = loss_of(model, case, x[rows], y[rows], case.plans[step]).item()
            err = compare_losses(f"eval after step {step}", ours, ref.eval_losses(case.plans[step], x, y), rank)
            worst["loss"] = max(worst["loss"], err)
    # The last writes reach the next forward and backward, and the parameters.
    step_and_compare(case.steps, case.plans[case.steps], "after the last step's writes")
    worst["param"] = compare_params("after the steps", model, ref.model)
    return worst


def run_cases(rank: int, world: int, seeds: List[int], progress_path: str) -> Dict:
    """Each seed's case in turn, in this one process group; stops at the first failure,
    which names the seed (the test runs the rest in a fresh group). A case that hangs
    (a collective one rank never joins) ends this rank after CASE_TIMEOUT_S, with every
    thread's stack printed: the launcher sees it die and the test names the seed from
    `progress_path`."""
    import faulthandler

    worst: Dict[str, Dict[str, float]] = {}  # per kind of case (family, precision, world): the largest errors
    for seed in seeds:
        with open(f"{progress_path}.{rank}", "w") as f:
            f.write(str(seed))
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        case = make_case(seed)
        assert case.world == world, (seed, case.world, world)
        try:
            result = (run_fp8_case if case.family == "fp8" else run_case)(case, rank)
        except BaseException as e:
            raise CaseFailure(f"property case seed={seed} failed ({case.summary()}); rerun: "
                              f"{RERUN.format(seed=seed)}\n{type(e).__name__}: {e}\n"
                              f"{''.join(traceback.format_exception(e))}") from None
        merge_worst(worst, {case.kind(): result})
    faulthandler.cancel_dump_traceback_later()
    return {"worst": worst, "cases": len(seeds)}


def merge_worst(into: Dict, other: Dict) -> None:
    """Per kind of case, the largest error of each kind seen in either."""
    for kind, errs in other.items():
        mine = into.setdefault(kind, dict.fromkeys(errs, 0.0))
        for k, v in errs.items():
            mine[k] = max(mine[k], v)


# ------------------------------------------------------------------ FP8 all-gather cases
# torchao's Float8Linear with enable_fsdp_float8_all_gather=True: our units gather the
# weights in FP8 (fp8.py). The reference is FSDP2 + torchao's own FP8 gather (ZeRO-3,
# the same units, bf16 parameters, fp32 reduction, scales precomputed after each step
# and after the writes), as in tests/harness/fp8_workers.py: losses, gradients and
# parameters agree to float rounding there, for every strategy of ours. FP8 matmuls want
# dims divisible by 16, so these graphs are plainer: residual FP8 blocks, a plain Linear
# gathered in bf16 beside the FP8 bytes, block units or not.


@dataclasses.dataclass
class Fp8Case:
    seed: int
    world: int
    family: str
    width: int
    hidden: List[int]  # one FP8 block per entry
    pre: bool  # a plain (bf16-gathered) Linear first, in the root's unit
    units: List[int]  # blocks that are units of their own
    strategy: str
    optimizer: str
    gather_bucket_bytes: int
    reduce_bucket_bytes: int
    prefetch_depth: int
    steps: int
    rows: int
    writes: List[List[Dict]]

    def kind(self) -> str:
        return f"fp8/world{self.world}"

    def summary(self) -> str:
        writes = sorted({w["op"] for step in self.writes for w in step})
        return (f"world={self.world} family=fp8 strategy={self.strategy} optimizer={self.optimizer} "
                f"width={self.width} hidden={self.hidden} pre={self.pre} units={self.units} "
                f"buckets=({self.gather_bucket_bytes},{self.reduce_bucket_bytes}) prefetch={self.prefetch_depth} "
                f"steps={self.steps} writes={writes}")


def make_fp8_case(seed: int) -> Fp8Case:
    rng = random.Random(seed)
    n_blocks = rng.randint(1, 3)
    steps = rng.choice([2, 3])
    return Fp8Case(
        seed=seed, world=world_of(seed), family="fp8", width=rng.choice([16, 32]),
        hidden=[rng.choice([16, 32, 48]) for _ in range(n_blocks)], pre=rng.random() < 0.5,
        units=[i for i in range(n_blocks) if rng.random() < 0.6], strategy=rng.choice(STRATEGIES),
        optimizer=rng.choice(["sgd", "adamw"]),
        gather_bucket_bytes=rng.choice([0, rng.randint(64, 2048), 1 << 20]),
        reduce_bucket_bytes=rng.choice([0, rng.randint(64, 2048), 1 << 20]),
        prefetch_depth=rng.choice([0, 1, 2]), steps=steps, rows=rng.choice([2, 4]),
        writes=[[{"op": rng.choice(WRITE_OPS), "pick": rng.random(), "seed": rng.randrange(1 << 30)}
                 for _ in range(rng.randint(0, 3))] for _ in range(steps)],
    )


class Fp8Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Fp8Net(nn.Module):
    def __init__(self, case: Fp8Case):
        super().__init__()
        d = case.width
        self.pre = nn.Linear(d, d) if case.pre else None
        self.blocks = nn.ModuleList(Fp8Block(d, h) for h in case.hidden)
        self.out = nn.Linear(d, 16)

    def forward(self, x):
        if self.pre is not None:
            x = self.pre(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def torchao_missing() -> str:
    """'' when torchao's float8 training imports here, else why not."""
    from .fp8_workers import torchao_missing as missing
    return missing()


def _fp8_model(case: Fp8Case) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(case.seed)
    return convert_to_float8_training(Fp8Net(case), config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                      module_filter_fn=lambda module, fqn: fqn != "pre")


def _fp8_shard_ours(case: Fp8Case) -> nn.Module:
    model = _fp8_model(case)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    keep = case.strategy != "optim_grads_params"
    kw = dict(sharding_strategy=case.strategy, mp_policy=mp, reshard_after_forward=not keep)
    for i in case.units:
        mfsdp.fully_shard(model.blocks[i], **kw)
    mfsdp.fully_shard(model, gather_bucket_bytes=case.gather_bucket_bytes,
                      reduce_bucket_bytes=case.reduce_bucket_bytes, prefetch_depth=case.prefetch_depth, **kw)
    return model


def _fp8_shard_fsdp2(case: Fp8Case) -> nn.Module:
    from .fp8_workers import _shard_fsdp2

    model = _fp8_model(case)
    return _shard_fsdp2(model, [model.blocks[i] for i in case.units])


def _fsdp2_write(op: str, p, new_full: torch.Tensor, bound: float) -> None:
    """The write's effect on an FSDP2 parameter: its full value changed as the op changes a
    plain tensor, and this rank's rows of it copied into the local shard (FSDP2 gathers
    from that storage; `p.data = x` would not reach it)."""
    full = p.full_tensor().detach().float().clone()
    if op in ("replace_data", "replace_param"):
        full = new_full
    else:
        _write(op, full, new_full, bound)
    with torch.no_grad():
        local = p.to_local()
        rows = full.chunk(dist.get_world_size(), dim=0)[dist.get_rank()]
        local.copy_(rows.to(local.dtype))


def _fp8_apply_writes(writes: List[Dict], ours: nn.Module, theirs: nn.Module) -> None:
    theirs_params = dict(theirs.named_parameters())
    names = list(theirs_params)
    for w in writes:
        op, name = w["op"], names[int(w["pick"] * len(names))]
        p = theirs_params[name]
        if op == "toggle_requires_grad":
            for q in (p, ours.get_parameter(name)):
                q.requires_grad_(not q.requires_grad)
            continue
        new_full = torch.randn(p.shape, generator=torch.Generator().manual_seed(w["seed"])) * 0.3
        full_now = p.full_tensor().detach()
        bound = 0.5 * full_now.abs().max().item()
        _fsdp2_write(op, p, new_full, bound)
        if op == "replace_param":
            requires_grad = replacement_requires_grad(w, p)
            p.requires_grad_(requires_grad)
            module = ours.get_submodule(name.rpartition(".")[0])
            setattr(module, name.rpartition(".")[2], nn.Parameter(new_full.clone(), requires_grad=requires_grad))
            continue
        mine = ours.get_parameter(name)
        piece = _shard_slice(mine)
        new = new_full.reshape(-1)[piece[0]:piece[0] + piece[1]].clone() if piece is not None else new_full
        _write(op, mine, new, bound)


def _fp8_compare(case: Fp8Case, when: str, ours, names, theirs, which: str) -> float:
    mine = full_grads(ours, names) if which == "grad" else mfsdp.full_state_dict(ours, rank0_only=False)
    worst = 0.0
    for name, p in theirs.named_parameters():
        t = p.grad if which == "grad" else p
        want = t.full_tensor().detach().float() if t is not None else None
        got = mine[name]
        if (got is None) != (want is None):
            raise CaseFailure(f"{when}: {which} of '{name}' is {'None' if got is None else 'set'}, FSDP2's "
                              f"is {'None' if want is None else 'set'}")
        if want is None:
            continue
        err = rel_err(got.reshape(want.shape), want)
        if not err <= TOL:
            raise CaseFailure(f"{when}: {which} of '{name}' rel err {err:.3e} against FSDP2 + torchao's")
        worst = max(worst, err)
    return worst


def run_fp8_case(case: Fp8Case, rank: int) -> Dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    ours, theirs = _fp8_shard_ours(case), _fp8_shard_fsdp2(case)
    names = shard_names(ours)
    opts = [make_optimizer(m.parameters(), case.optimizer) for m in (ours, theirs)]
    rows = slice(rank * case.rows, (rank + 1) * case.rows)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(case.steps + 1):  # the last: what the last writes left
        when = f"step {step}" if step < case.steps else "after the last step's writes"
        g = torch.Generator().manual_seed(case.seed * 1000 + step)
        x = torch.randn(case.world * case.rows, case.width, generator=g)
        y = torch.randn(case.world * case.rows, 16, generator=g)
        losses = []
        for m, o in zip((ours, theirs), opts):
            o.zero_grad(set_to_none=True)
            loss = F.mse_loss(m(x[rows]).float(), y[rows])
            loss.backward()
            losses.append(loss.item())
        err = abs(losses[0] - losses[1]) / abs(losses[1])
        if not err <= TOL:
            raise CaseFailure(f"{when}: loss on rank {rank} {losses[0]!r} vs FSDP2 + torchao's {losses[1]!r}")
        worst["loss"] = max(worst["loss"], err)
        worst["grad"] = max(worst["grad"], _fp8_compare(case, when, ours, names, theirs, "grad"))
        if step == case.steps:
            break
        for o in opts:
            o.step()
        _fp8_apply_writes(case.writes[step], ours, theirs)
        precompute_float8_dynamic_scale_for_fsdp(theirs)  # torchao's contract after the weights change
    worst["param"] = _fp8_compare(case, "after the steps", ours, names, theirs, "value")
    return worst



# --------------------------------------------------------------- findings, as fixed cases
class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool = True):
        x = self.a(x)
        return self.b(x) if use_b else x


def _two_layers(strategy: str) -> TwoLayers:
    model = TwoLayers()
    keep = strategy != "optim_grads_params"
    for m in (model.b, model):
        mfsdp.fully_shard(m, sharding_strategy=strategy, reshard_after_forward=not keep)
    return model


def replaced_param_findings(rank: int, world: int) -> Dict[str, Dict[str, bool]]:
    """Per strategy, what `model.b.weight = nn.Parameter(full)` leads to (each True where
    the model behaves as the plain one):
    - adopted_by_a_step_that_skips_b: after a step whose forward does not call b,
      model.parameters() yields b's shard again, not the orphaned replacement (seed 56);
    - rebuilt_optimizer_trains_b: an optimizer built from model.parameters() then trains b;
    - frozen_replacement_stays_frozen: a replacement made with requires_grad=False gets
      no gradient at the next step (seeds 740, 1258, 1323, 2337, FP8 1769).
    Both were bugs, fixed in 010cef3."""
    report = {}
    for strategy in STRATEGIES:
        model = _two_layers(strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        new = torch.full((4, 4), 7.0)
        model.b.weight = nn.Parameter(new.clone())
        model(torch.randn(2, 4), use_b=False).sum().backward()
        opt.step()
        opt.zero_grad()
        adopted = all(_shard_slice(p) is not None for p in model.parameters())
        rebuilt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        rebuilt.step()
        rebuilt.zero_grad()
        trained = not torch.equal(mfsdp.full_state_dict(model, rank0_only=False)["b.weight"], new)

        model.b.weight = nn.Parameter(new.clone(), requires_grad=False)
        model(torch.ones(2, 4)).sum().backward()
        frozen = model.b.weight.grad is None and not model.b.weight.requires_grad
        report[strategy] = {"adopted_by_a_step_that_skips_b": adopted, "rebuilt_optimizer_trains_b": trained,
                            "frozen_replacement_stays_frozen": frozen}
    return report

# ----------------------------------------------------------------- the test process side
def run_seeds(world: int, seeds: List[int], progress_dir: str, timeout: float) -> Dict:
    """All `seeds` (cases of this world) in as few process groups as failures allow: a
    failing case ends its group (the ranks may be mid-collective), is recorded, and the
    seeds after it run in a fresh one. Returns {"worst": ..., "cases": passed count,
    "failures": {seed: message}}."""
    import re

    from .launcher import DistributedTestError, run_distributed

    progress = os.path.join(progress_dir, f"progress_w{world}")
    failures: Dict[int, str] = {}
    worst: Dict = {}
    passed, todo = 0, list(seeds)
    while todo:
        try:
            result = run_distributed(run_cases, world, todo, progress, timeout=timeout)[0]
        except DistributedTestError as e:
            text = str(e)
            found = re.search(r"property case seed=(\d+) failed", text)
            if found:
                seed = int(found.group(1))
            else:  # a hang (ended by the rank's watchdog) or a crash: the case rank 0 was in
                with open(f"{progress}.0") as f:
                    seed = int(f.read())
                text = (f"property case seed={seed} hung (no result in {CASE_TIMEOUT_S} s: every thread's stack is "
                        f"in the captured stderr) or crashed ({make_case(seed).summary()}); rerun: "
                        f"{RERUN.format(seed=seed)}\n{text}")
            failures[seed] = text
            passed += todo.index(seed)
            todo = todo[todo.index(seed) + 1:]
            continue
        passed += result["cases"]
        merge_worst(worst, result["worst"])
        todo = []
    return {"worst": worst, "cases": passed, "failures": failures}


def failure_report(failures: Dict[int, str]) -> str:
    """One paragraph per failed seed: what failed and how to rerun it; the first one's
    traceback in full."""
    lines = [f"{len(failures)} property case(s) failed: seeds {sorted(failures)}"]
    for i, (seed, text) in enumerate(sorted(failures.items())):
        if i == 0:
            lines.append(text)
        else:
            head = [l for l in text.splitlines() if l.startswith(("harness.property_workers.CaseFailure",
                                                                   "CaseFailure", "property case"))]
            lines.append("\n".join(head[:2]) or text[:1500])
    return "\n\n".join(lines)
