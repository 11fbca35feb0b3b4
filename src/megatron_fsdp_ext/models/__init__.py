"""Reference models used by the example, the tests and the benchmarks."""
from .llama import Block, LlamaConfig, LlamaModel, tensor_parallel
from .moe import MoEBlock, MoEConfig, MoEModel, expert_parallel

__all__ = ["Block", "LlamaConfig", "LlamaModel", "tensor_parallel", "MoEBlock", "MoEConfig", "MoEModel",
           "expert_parallel"]
