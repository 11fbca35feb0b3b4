"""What every benchmark JSON records about its run, so that the raw file committed
under benchmarks/data/ says by itself when, where, on what and how it was measured."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp


def git_commit() -> str | None:
    """MFSDP_COMMIT if set (the GPU machine gets a copy of the tree without .git), else
    the checkout's HEAD (with '-dirty' when tracked files are modified), else None."""
    if os.environ.get("MFSDP_COMMIT"):
        return os.environ["MFSDP_COMMIT"]
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def init_benchmark_process(device_choice: str, standalone_port: int) -> torch.device:
    """Join the job (NCCL on CUDA, Gloo otherwise) and return this rank's device.
    `device_choice` is a script's --device ("auto", "cpu", "cuda"); run without torchrun,
    the script is a world of one on `standalone_port`."""
    use_cuda = torch.cuda.is_available() and device_choice != "cpu"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(standalone_port))
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return device


def run_meta(device: torch.device) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "world": world,
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "driver": _nvidia_driver() if cuda else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "commit": git_commit(),
        "command": f"torchrun --nproc_per_node={int(os.environ.get('LOCAL_WORLD_SIZE', world))} "
                   + " ".join(shlex.quote(a) for a in sys.argv),
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "TORCH_SYMM_MEM_DISABLE_MULTICAST"},
        "build": mfsdp.build_info(),
    }


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None
