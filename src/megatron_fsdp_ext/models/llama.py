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
INIT_STD = 0.02


class Linear(nn.Linear):
    """A bias-free linear layer initialized N(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float = INIT_STD):
        self.init_std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, self.init_std)


class Embedding(nn.Embedding):
    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, INIT_STD)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        # torch's fused kernel (it accumulates in fp32 for low-precision inputs): an
        # unfused norm costs several kernels and hides per-unit overhead in benchmarks.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


# Rotary tables per (sequence length, head dim, device, dtype), made once: rebuilding
# them every forward costs more kernels than the attention itself on small layers.
_ROPE_TABLES: dict = {}


def _make_rope_tables(seq_len: int, head_dim: int, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout (Hugging Face Llama's)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _rope_tables(seq_len: int, head_dim: int, device, dtype):
    if torch.compiler.is_compiling():  # traced into the graph: inductor folds it
        return _make_rope_tables(seq_len, head_dim, device, dtype)
    key = (seq_len, head_dim, torch.device(device), dtype)
    if key not in _ROPE_TABLES:
        # Plain tensors even when the first call runs under inference_mode: a later
        # training forward saves them for backward.
        with torch.inference_mode(False), torch.no_grad():
            _ROPE_TABLES[key] = _make_rope_tables(seq_len, head_dim, device, dtype)
    return _ROPE_TABLES[key]


def _apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def residual_std(cfg: LlamaConfig) -> float:
    """Scaled init of the projections into the residual stream (GPT-2 style)."""
    return INIT_STD / math.sqrt(2 * cfg.n_layers)


class Attention(nn.Module):
    """Causal self-attention with a fused q/k/v projection laid out head-major (each
    head's q, k, v rows together), so that tensor parallelism's contiguous row chunks of
    wqkv hold whole heads; the head count is read from the projection's output, which is
    this rank's heads under TP."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wqkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.wo = Linear(cfg.d_model, cfg.d_model, residual_std(cfg))

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.wqkv(x).view(b, s, -1, 3, self.head_dim).unbind(3)
        cos, sin = _rope_tables(s, self.head_dim, q.device, q.dtype)
        q = _apply_rope(q, cos[:, None, :], sin[:, None, :]).transpose(1, 2)
        k = _apply_rope(k, cos[:, None, :], sin[:, None, :]).transpose(1, 2)
        v = v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """SwiGLU with a fused gate/up projection laid out unit-major (each hidden unit's gate
    and up rows together), so that TP's row chunks of w_gate_up hold whole units."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w_gate_up = Linear(cfg.d_model, 2 * cfg.ffn_hidden)
        self.w_down = Linear(cfg.ffn_hidden, cfg.d_model, residual_std(cfg))

    def forward(self, x):
        gate, up = self.w_gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)
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


class Decoder(nn.Module):
    """Embedding, `cfg.n_layers` blocks of `block_class`, final norm and output head (tied
    to the embedding with cfg.tie_embeddings); the models differ in their blocks."""

    block_class: type  # set by each model

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layers))
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


class LlamaModel(Decoder):
    block_class = Block


def tensor_parallel(model: LlamaModel, tp_mesh, sequence_parallel: bool = True) -> LlamaModel:
    """Megatron-style tensor parallelism on `tp_mesh` (torch's parallelize_module, the
    plan torchtitan applies to its Llama): wqkv and w_gate_up column-parallel, wo and
    w_down row-parallel, the embedding row-parallel over the vocabulary and the head
    column-parallel over it; with sequence_parallel the norms and the residual stream run
    on sequence shards. Tied embedding and head stay tied (both are split on the
    vocabulary dim). Call before fully_shard; the heads, ffn_hidden and vocabulary must
    divide by the TP degree."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    cfg, size = model.cfg, tp_mesh.size()
    for what, n in (("n_heads", cfg.n_heads), ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if n % size:
            raise ValueError(f"tensor_parallel: {what}={n} is not divisible by the TP degree {size}")
    seq = Shard(1) if sequence_parallel else Replicate()
    tied = model.head.weight is model.embed.weight
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.blocks:
        plan = {
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.wqkv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    if tied:  # parallelize_module made two DTensors of the one tensor, placed alike
        model.head.weight = model.embed.weight
    return model
