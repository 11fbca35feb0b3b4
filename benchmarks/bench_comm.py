"""Collective benchmark through megatron_fsdp_ext's C++ Communicator.

    torchrun --nproc_per_node=2 benchmarks/bench_comm.py

Measures all-gather and reduce-scatter bus bandwidth over buffer sizes, and an
all-gather + reduce-scatter pair issued together on two streams with one shared
communicator vs two communicators (the reason units get a separate all-gather group).
Bus bandwidth follows nccl-tests: bytes * (world - 1) / world / time. Also times the
uneven collectives (all_gather_v, reduce_scatter_v) per algorithm: GROUPED (NCCL
grouped per-rank collectives into views), PADDED (pad to the longest segment, even
collective, compact) and, for reduce_scatter_v, ALL_REDUCE.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_fsdp_ext import _C


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def uneven_rows(comm, sizes_mib, iters, world, rank):
    """all_gather_v / reduce_scatter_v with owner-style uneven segments (rank r holds
    (r + 1) parts of the total, the last rank's segment empty for world > 2): each
    algorithm the C++ Communicator offers, so AUTO can be chosen by size."""
    rows = []
    weights = [r + 1 for r in range(world)]
    if world > 2:
        weights[-1] = 0
    for mib in sizes_mib:
        total = int(mib * 2**20) // 4  # fp32 elements, like the layer-wise buckets
        numels = [total * w // sum(weights) for w in weights]
        starts = [sum(numels[:r]) for r in range(world)]
        full = torch.empty(sum(numels), device="cuda")
        mine = torch.randn(numels[rank], device="cuda")
        grads = torch.randn(sum(numels), device="cuda")
        red = torch.empty(numels[rank], device="cuda")
        row = {"mib": mib}
        for algo in ("GROUPED", "PADDED"):
            a = getattr(_C.VarAlgo, algo)
            row[f"ag_v_{algo.lower()}_ms"] = 1e3 * timed(lambda: comm.all_gather_v(full, mine, starts, numels, a), iters)
        for algo in ("GROUPED", "PADDED", "ALL_REDUCE"):
            a = getattr(_C.VarAlgo, algo)
            row[f"rs_v_{algo.lower()}_ms"] = 1e3 * timed(lambda: comm.reduce_scatter_v(red, grads, starts, numels, a), iters)
        rows.append(row)
        if rank == 0:
            print(f"{mib:7.0f} MiB uneven  " + "  ".join(f"{k[:-3]} {v:.3f} ms" for k, v in row.items() if k != "mib"),
                  flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="4,16,64,256,1024")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--uneven-mib", default="1,16,64,256",
                   help="total sizes for all_gather_v / reduce_scatter_v (GROUPED vs PADDED vs ALL_REDUCE)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_comm.py measures NCCL: it needs CUDA GPUs (run under torchrun)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    world, rank = dist.get_world_size(), dist.get_rank()
    comm_a = _C.Communicator(dist.distributed_c10d._get_default_group())
    comm_b = _C.Communicator(dist.new_group(ranks=list(range(world)), backend="nccl"))
    s_ag, s_rs = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for mib in (float(x) for x in args.sizes_mib.split(",")):
        n = int(mib * 2**20) // 2 // world * world  # bf16 elements, divisible by world
        full = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        shard = torch.randn(n // world, device="cuda").to(torch.bfloat16)
        grads = torch.randn(n, device="cuda").to(torch.bfloat16)
        out = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
        nbytes = n * 2

        def ag(c=comm_a):
            c.all_gather_flat(full, shard)

        def rs(c=comm_a):
            c.reduce_scatter_flat(out, grads)

        def pair(c_ag, c_rs):
            def run():
                cur = torch.cuda.current_stream()
                s_ag.wait_stream(cur)
                s_rs.wait_stream(cur)
                with torch.cuda.stream(s_ag):
                    c_ag.all_gather_flat(full, shard)
                with torch.cuda.stream(s_rs):
                    c_rs.reduce_scatter_flat(out, grads)
                cur.wait_stream(s_ag)
                cur.wait_stream(s_rs)
            return run

        t_ag, t_rs = timed(ag, args.iters), timed(rs, args.iters)
        t_one, t_two = timed(pair(comm_a, comm_a), args.iters), timed(pair(comm_a, comm_b), args.iters)
        bus = nbytes * (world - 1) / world
        row = {"mib": mib, "ag_ms": t_ag * 1e3, "rs_ms": t_rs * 1e3,
               "ag_busbw_gbs": bus / t_ag / 1e9, "rs_busbw_gbs": bus / t_rs / 1e9,
               "pair_one_comm_ms": t_one * 1e3, "pair_two_comms_ms": t_two * 1e3,
               "two_vs_one": t_two / t_one}
        rows.append(row)
        if rank == 0:
            print(f"{mib:7.0f} MiB  AG {row['ag_ms']:7.3f} ms ({row['ag_busbw_gbs']:6.1f} GB/s)  "
                  f"RS {row['rs_ms']:7.3f} ms ({row['rs_busbw_gbs']:6.1f} GB/s)  "
                  f"AG||RS one comm {t_one * 1e3:7.3f} ms, two comms {t_two * 1e3:7.3f} ms "
                  f"({row['two_vs_one']:.2f}x)", flush=True)
    uneven = uneven_rows(comm_a, [float(x) for x in args.uneven_mib.split(",") if x], args.iters, world, rank)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "world": world, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        (out / "comm.json").write_text(json.dumps({"meta": meta, "rows": rows, "uneven": uneven}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
