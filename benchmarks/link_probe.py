"""What the "auto" bucket budget sees: the link megatron_fsdp_ext.link measures on this
job's process group, the budget it derives, and how well the two-point model predicts
all-gathers of other sizes (timed the same way: the slowest rank's median).

    torchrun --nproc_per_node=2 benchmarks/link_probe.py --out $OUT/link.json            # NCCL
    torchrun --nproc_per_node=4 benchmarks/link_probe.py --backend gloo --out ...       # ranks sharing GPUs

--backend gloo with CUDA tensors is the 1-GPU-many-ranks setup (ranks share the GPUs).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import run_meta  # noqa: E402

from megatron_fsdp_ext import link  # noqa: E402

CHECK_BYTES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def timed_gather(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    world = dist.get_world_size()
    inp = torch.empty(max(1, nbytes // world), dtype=torch.uint8, device=device)
    out = torch.empty(inp.numel() * world, dtype=torch.uint8, device=device)
    times = []
    for i in range(2 + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, inp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--repeats", type=int, default=3, help="measurements of the link (each as the library does it)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = args.backend or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    group = dist.group.WORLD
    measured = []
    for _ in range(args.repeats):
        model = link.measure_link(group, device)
        measured.append({**dataclasses.asdict(model), "budget_bytes": link.auto_bucket_bytes(model)})
    model = link.LinkModel(measured[-1]["alpha_s"], measured[-1]["bytes_per_s"])
    checks = [{"bytes": n, "measured_s": timed_gather(n, device), "predicted_s": model.seconds(n)}
              for n in CHECK_BYTES]
    if dist.get_rank() == 0:
        result = {"meta": run_meta(device), "backend": backend, "latency_share": link.LATENCY_SHARE,
                  "probe_bytes": [link.SMALL_PROBE_BYTES, *link.LARGE_PROBE_BYTES], "measurements": measured, "checks": checks}
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
