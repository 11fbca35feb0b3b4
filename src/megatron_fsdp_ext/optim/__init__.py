"""CPU optimizers for offloaded shards: Adam/AdamW and SGD stepped in C++ on host memory
(cpu.py, csrc/cpu_optim.cpp). Imports only the core."""
from .cpu import CPUAdam, CPUAdamW, CPUSGD, num_threads, set_num_threads

__all__ = ["CPUAdam", "CPUAdamW", "CPUSGD", "num_threads", "set_num_threads"]
