"""Reference models used by the example, the tests and the benchmarks."""
from .llama import Block, LlamaConfig, LlamaModel

__all__ = ["Block", "LlamaConfig", "LlamaModel"]
