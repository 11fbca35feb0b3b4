"""Helpers for multi-process tests: a launcher with a hard timeout and the workers
shared by the Gloo (CPU) and NCCL (GPU) test suites."""
from .launcher import DistributedTestError, gpu_world, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
