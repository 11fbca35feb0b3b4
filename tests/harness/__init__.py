"""Multi-process test harness (not installed with the package): a launcher with a hard
timeout, and the workers shared by the Gloo (CPU) and NCCL (GPU) suites, by topic:
workers (parity, state dicts, layer-wise, shared helpers), option_workers (options and
APIs), strategy_workers (sharding strategies), gpu_workers (CUDA-only: memory, overlap,
CUDA graphs). tests/conftest.py puts tests/ on sys.path, so `import harness` works in
the test processes and in the ranks they spawn."""
from .launcher import (DistributedTestError, gpu_backend, gpu_launch, gpu_world, gpus_needed, run_distributed,
                       run_script)

__all__ = ["DistributedTestError", "gpu_backend", "gpu_launch", "gpu_world", "gpus_needed", "run_distributed",
           "run_script"]
