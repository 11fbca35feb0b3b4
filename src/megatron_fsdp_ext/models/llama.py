"""A small Llama-style decoder: token embedding, pre-norm blocks (RMSNorm, causal
self-attention with rotary embeddings, SwiGLU MLP), final RMSNorm and an output head
that can be tied to the embedding."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 172
    max_seq_len: int = 512
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward, 6N plus attention scores)."""
        d, f, L = self.d_model, self.ffn_hidden, self.n_layers
        per_layer = 4 * d * d + 3 * d * f
        head = d * self.vocab_size
        return 6.0 * (L * per_layer + head) + 12.0 * L * d * seq_len


# Every module initializes its own parameters in reset_parameters(), called by its
# constructor: building the model runs them in module order, which is what
# megatron_fsdp_ext.materialize() replays for a model built on the meta device.
_INIT_STD = 0.02


class Linear(nn.Linear):
    """A bias-free linear layer initialized N(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float = _INIT_STD):
        self.init_std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, self.init_std)


class Embedding(nn.Embedding):
    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, _INIT_STD)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        # Normalise in fp32 for stability, return in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def _rope_tables(seq_len: int, head_dim: int, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def _residual_std(cfg: LlamaConfig) -> float:
    """Scaled init of the projections into the residual stream (GPT-2 style)."""
    return _INIT_STD / math.sqrt(2 * cfg.n_layers)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wqkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.wo = Linear(cfg.d_model, cfg.d_model, _residual_std(cfg))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.n_heads, self.head_dim).unbind(2)
        cos, sin = _rope_tables(s, self.head_dim, x.device, x.dtype)
        q = _apply_rope(q, cos[:, None, :], sin[:, None, :]).transpose(1, 2)
        k = _apply_rope(k, cos[:, None, :], sin[:, None, :]).transpose(1, 2)
        v = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w_gate_up = Linear(cfg.d_model, 2 * cfg.ffn_hidden)
        self.w_down = Linear(cfg.ffn_hidden, cfg.d_model, _residual_std(cfg))

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens, targets):
        logits = self(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
