"""The model shapes every benchmark draws from: one table, so a name means one model.

A shape is (vocab, d_model, layers, heads, ffn, micro_batch, seq) of the Llama-style
`megatron_fsdp_ext.models.LlamaModel` (no GQA). Each benchmark names the shapes it runs in
its own CONFIGS, built from these with `_replace` where it uses another depth or batch.
"""
from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    vocab: int
    d_model: int
    layers: int
    heads: int
    ffn: int
    micro_batch: int
    seq: int


TINY = Shape(256, 64, 4, 4, 176, 2, 32)  # CPU smoke runs
SMALL_MANY = Shape(8192, 512, 48, 8, 1536, 8, 512)  # 172M in 48 small layers: per-unit overhead shows
LLAMA_1_3B = Shape(32000, 2048, 24, 16, 5504, 4, 2048)
LLAMA_3B = Shape(32000, 3072, 26, 24, 8192, 1, 2048)
LLAMA_7B = Shape(32000, 4096, 32, 32, 11008, 1, 2048)
# 12.7B parameters: fp32 AdamW training takes 16 bytes a parameter, 204 GB, more than one
# H200 (141 GB); built on the meta device where a benchmark allows it.
LLAMA_13B = Shape(32000, 5120, 40, 40, 13824, 1, 1024)
LLAMA_70B = Shape(32000, 8192, 80, 64, 28672, 1, 1024)
LLAMA_405B = Shape(32000, 16384, 126, 128, 53248, 1, 256)
