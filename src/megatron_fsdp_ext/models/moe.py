"""A Llama-style mixture-of-experts decoder for the benchmarks and tests: the Llama blocks
with the SwiGLU MLP replaced by top-k routed experts (GShard-style fixed capacity, so
every shape is known without a host synchronization), whose weights are grouped
`[experts, ...]` tensors a batched GEMM reads in one call.

Expert parallelism (`expert_parallel`): each rank of an "ep" mesh holds `experts / ep` of
them as DTensors `Shard(0)` (torchtitan's layout), and each MoE layer sends every expert
its tokens with one all-to-all over the ep group and brings the results back with a
second one. Sharding the experts over the expert data-parallel mesh is the FSDP
library's business (FSDP2's ShardPlacementResult, or a unit of its own on that mesh)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .llama import INIT_STD, Attention, Decoder, LlamaConfig, Linear, RMSNorm, residual_std


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128  # each expert's SwiGLU width
    # Slots per expert: capacity_factor x its fair share of the (token, choice) pairs;
    # pairs routed past an expert's slots are dropped (their token keeps its residual).
    capacity_factor: float = 1.25

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(tokens * self.top_k / self.n_experts * self.capacity_factor))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as routed (top_k experts per token, capacity ignored)."""
        d, L = self.d_model, self.n_layers
        per_layer = 4 * d * d + d * self.n_experts + self.top_k * 3 * d * self.expert_hidden
        return 6.0 * (L * per_layer + d * self.vocab_size) + 12.0 * L * d * seq_len


class GroupedExperts(nn.Module):
    """`n_experts` SwiGLU experts as two grouped weights: w_gate_up [E, 2H, d] (each hidden
    unit's gate and up rows together) and w_down [E, d, H]. forward takes [local experts,
    tokens, d] and runs each expert on its own tokens with one batched GEMM per weight."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, h, d = cfg.n_experts, cfg.expert_hidden, cfg.d_model
        self.down_std = residual_std(cfg)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * h, d))
        self.w_down = nn.Parameter(torch.empty(e, d, h))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.w_gate_up, 0.0, INIT_STD)
        nn.init.normal_(self.w_down, 0.0, self.down_std)

    @staticmethod
    def _local(w):
        return w.to_local() if hasattr(w, "to_local") else w

    def forward(self, x):
        w_gate_up, w_down = self._local(self.w_gate_up), self._local(self.w_down)
        if w_gate_up.shape[0] != x.shape[0]:
            raise ValueError(f"GroupedExperts holds {w_gate_up.shape[0]} experts here but got tokens for {x.shape[0]}")
        gate, up = torch.bmm(x, w_gate_up.to(x.dtype).transpose(1, 2)).unflatten(-1, (-1, 2)).unbind(-1)
        return torch.bmm(F.silu(gate) * up, w_down.to(x.dtype).transpose(1, 2))


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over `group` along dim 0 (its backward is the same exchange)."""

    @staticmethod
    def exchange(x, group):
        # Both buffers contiguous: empty_like of a strided tensor (a transposed gradient)
        # keeps its strides, and the collective reads and writes plain row-major memory.
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _AllToAll.exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.exchange(grad, ctx.group), None


class MoEFeedForward(nn.Module):
    """Top-k routing (softmax over the experts, the chosen weights renormalized), a fixed
    number of slots per expert, the experts (all of them, or this rank's under expert
    parallelism), and the weighted sum of each token's expert outputs."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Linear(cfg.d_model, cfg.n_experts)
        self.experts = GroupedExperts(cfg)
        self.ep_group: Optional[dist.ProcessGroup] = None  # set by expert_parallel()

    def forward(self, x):
        cfg = self.cfg
        shape, d, e = x.shape, x.shape[-1], cfg.n_experts
        tokens = x.reshape(-1, d)
        n = tokens.shape[0]
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = probs.topk(cfg.top_k, dim=-1)  # [n, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        capacity = cfg.capacity(n)
        # Each (token, choice) pair's place among its expert's pairs, in token order.
        flat = chosen.reshape(-1)
        place = (torch.cumsum(F.one_hot(flat, e), dim=0) - 1).gather(1, flat[:, None]).squeeze(1)
        kept = place < capacity
        slot = (flat * capacity + place)[kept]
        token_of = torch.arange(n, device=x.device).repeat_interleave(cfg.top_k)[kept]
        dispatched = tokens.new_zeros(e * capacity, d).index_put((slot,), tokens[token_of])
        out = self._run_experts(dispatched.view(e, capacity, d))
        combined = out.reshape(e * capacity, d)[slot] * weights.reshape(-1)[kept][:, None]
        return tokens.new_zeros(n, d).index_add(0, token_of, combined).view(shape)

    def _run_experts(self, dispatched):
        """[experts, slots, d] of this rank's tokens -> the experts' outputs, same shape."""
        group = self.ep_group
        ep = 1 if group is None else dist.get_world_size(group)
        if ep == 1:
            return self.experts(dispatched)
        e, c, d = dispatched.shape
        local = e // ep
        # Rank j's experts are block j: after the exchange, block j holds rank j's tokens
        # for this rank's experts.
        received = _AllToAll.apply(dispatched.view(ep, local, c, d), group)
        y = self.experts(received.transpose(0, 1).reshape(local, ep * c, d))
        back = y.view(local, ep, c, d).transpose(0, 1).contiguous()
        return _AllToAll.apply(back, group).view(e, c, d)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEModel(Decoder):
    block_class = MoEBlock


def expert_parallel(model: MoEModel, ep_mesh) -> MoEModel:
    """Give each rank of the 1-D `ep_mesh` its `n_experts / ep` experts: every grouped
    weight becomes a DTensor Shard(0) on ep_mesh holding this rank's slice of the full
    one (on the meta device, a meta slice), and every MoE layer exchanges tokens over
    ep_mesh's group. Call before sharding with an FSDP library."""
    from torch.distributed.tensor import DTensor, Shard

    if ep_mesh.ndim != 1:
        raise ValueError(f"expert_parallel takes a 1-D ep mesh, got {ep_mesh.ndim}-D {ep_mesh.mesh_dim_names}")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if model.cfg.n_experts % ep:
        raise ValueError(f"expert_parallel: n_experts={model.cfg.n_experts} is not divisible by the EP degree {ep}")
    local = model.cfg.n_experts // ep
    for block in model.blocks:
        experts = block.moe.experts
        for name in ("w_gate_up", "w_down"):
            full = getattr(experts, name).detach()
            piece = full[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False)))
        block.moe.ep_group = ep_mesh.get_group()
    return model
