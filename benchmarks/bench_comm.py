"""Collective benchmark through megatron_fsdp_ext's C++ Communicator.

    torchrun --nproc_per_node=2 benchmarks/bench_comm.py

Measures all-gather and reduce-scatter bus bandwidth over buffer sizes, and an
all-gather + reduce-scatter pair issued together on two streams with one shared
communicator vs two communicators (the reason units get a separate all-gather group).
Bus bandwidth follows nccl-tests: bytes * (world - 1) / world / time. Also times the
uneven collectives (all_gather_v, reduce_scatter_v) per algorithm: GROUPED (NCCL
grouped per-rank collectives into views), PADDED (pad to the longest segment, even
collective, compact) and, for reduce_scatter_v, ALL_REDUCE.

Timing: every rank times every iteration (CUDA events); per iteration the slowest
rank's time counts (all-reduce MAX after the timed loop, so it adds nothing to the
loop); reported are the median and the spread (10th/90th percentile, min, max) over
--iters iterations after --warmup untimed ones, and comm.json keeps every iteration.
`--registered` also times, per size, the in-place all-gather and the reduce-scatter on
buffers the process group allocates (Backend.allocate_tensor: NCCL memory registered with
the communicator, what set_allocate_memory_from_process_group_for_comm gives units)
against the same on torch's caching allocator, with the NCCL kernel grid (the SMs each
collective takes) from one profiled iteration of each.
`--device cpu` runs the same code over Gloo (wall clock; no stream pair, no GROUPED):
a functional check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_fsdp_ext import _C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import run_meta  # noqa: E402


class Timer:
    """Per-iteration times of the slowest rank (see the module docstring)."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.raw_ms = {}  # measurement name -> slowest rank's ms per iteration

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, name: str, fn) -> float:
        """Time fn; keep the per-iteration times under `name`; return the median in s."""
        for _ in range(self.warmup):
            fn()
        self._sync()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.raw_ms[name] = [t * 1e3 for t in slowest.tolist()]
        return statistics.median(slowest.tolist())

    def spread(self, name: str) -> dict:
        """Spread of `name`'s per-iteration times in ms: min, 10th/90th percentile, max."""
        ms = sorted(self.raw_ms[name])
        deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else ms * 9
        return {"min": ms[0], "p10": deciles[0], "p90": deciles[-1], "max": ms[-1]}


def group_buffer(group, numel: int, dtype: torch.dtype, device: torch.device):
    """`numel` elements allocated by `group`'s backend, or None where it cannot allocate."""
    backend = group._get_backend(device)
    if device.type != "cuda" or not backend.supports_tensor_alloc(device):
        return None
    return backend.allocate_tensor(numel, dtype=dtype, device=device)


def nccl_grids(fn) -> dict:
    """The NCCL kernel summary (kernels, time, largest grid) of one profiled call of fn."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from megatron_fsdp_ext.trace import nccl_kernel_summary

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return nccl_kernel_summary(f.name)


def registered_row(comm, group, n: int, timer, world: int, rank: int, mib: float) -> dict:
    """In-place all-gather (the input is the output's own segment, as units gather) and
    reduce-scatter of n bf16 elements, on caching-allocator and on group-allocated buffers."""
    device = timer.device
    row = {}
    for source in ("caching", "group"):
        if source == "group":
            full, grads = group_buffer(group, n, torch.bfloat16, device), group_buffer(group, n, torch.bfloat16, device)
            if full is None:
                row["group"] = "the backend does not allocate"
                return row
        else:
            full, grads = (torch.empty(n, dtype=torch.bfloat16, device=device) for _ in range(2))
        grads.normal_()
        mine = full.narrow(0, rank * (n // world), n // world)
        mine.normal_()
        out = torch.empty(n // world, dtype=torch.bfloat16, device=device)

        def ag():
            comm.all_gather_flat(full, mine)

        def rs():
            comm.reduce_scatter_flat(out, grads)

        t_ag, t_rs = timer(f"{mib:g}MiB_ag_{source}", ag), timer(f"{mib:g}MiB_rs_{source}", rs)
        bus = n * 2 * (world - 1) / world
        row[source] = {"ag_ms": t_ag * 1e3, "ag_spread_ms": timer.spread(f"{mib:g}MiB_ag_{source}"),
                       "rs_ms": t_rs * 1e3, "rs_spread_ms": timer.spread(f"{mib:g}MiB_rs_{source}"),
                       "ag_busbw_gbs": bus / t_ag / 1e9, "rs_busbw_gbs": bus / t_rs / 1e9,
                       "ag_kernels": nccl_grids(ag), "rs_kernels": nccl_grids(rs)}
    return row


def uneven_rows(comm, sizes_mib, timer, world, rank):
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
        device = timer.device
        full = torch.empty(sum(numels), device=device)
        mine = torch.randn(numels[rank], device=device)
        grads = torch.randn(sum(numels), device=device)
        red = torch.empty(numels[rank], device=device)
        row, medians = {"mib": mib}, {}
        grouped = ("GROUPED",) if device.type == "cuda" else ()  # GROUPED needs NCCL
        for algo in grouped + ("PADDED",):
            a, name = getattr(_C.VarAlgo, algo), f"ag_v_{algo.lower()}"
            medians[name] = 1e3 * timer(f"{mib:g}MiB_{name}", lambda: comm.all_gather_v(full, mine, starts, numels, a))
        for algo in grouped + ("PADDED", "ALL_REDUCE"):
            a, name = getattr(_C.VarAlgo, algo), f"rs_v_{algo.lower()}"
            medians[name] = 1e3 * timer(f"{mib:g}MiB_{name}",
                                        lambda: comm.reduce_scatter_v(red, grads, starts, numels, a))
        for name, median in medians.items():
            row[f"{name}_ms"] = median
            row[f"{name}_spread_ms"] = timer.spread(f"{mib:g}MiB_{name}")
        rows.append(row)
        if rank == 0:
            print(f"{mib:7g} MiB uneven  " + "  ".join(f"{k} {v:.3f}" for k, v in medians.items()) + " ms (median)",
                  flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="4,16,64,256,1024")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per measurement (slowest rank each)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before each measurement")
    p.add_argument("--uneven-mib", default="1,16,64,256",
                   help="total sizes for all_gather_v / reduce_scatter_v (GROUPED vs PADDED vs ALL_REDUCE)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu: Gloo, a functional check only (default: CUDA when available)")
    p.add_argument("--registered", action="store_true",
                   help="also time collectives on process-group-allocated (NCCL-registered) buffers")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not use_cuda:
        raise SystemExit("--device cuda given but no CUDA device is visible")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29563")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    world, rank = dist.get_world_size(), dist.get_rank()
    comm_a = _C.Communicator(dist.distributed_c10d._get_default_group())
    comm_b = _C.Communicator(dist.new_group(ranks=list(range(world)), backend=backend))
    timer = Timer(device, args.iters, args.warmup)
    rows = []
    for mib in (float(x) for x in args.sizes_mib.split(",") if x):
        n = max(int(mib * 2**20) // 2 // world * world, world)  # bf16 elements, divisible by world
        full = torch.empty(n, dtype=torch.bfloat16, device=device)
        shard = torch.randn(n // world, device=device).to(torch.bfloat16)
        grads = torch.randn(n, device=device).to(torch.bfloat16)
        out = torch.empty(n // world, dtype=torch.bfloat16, device=device)
        nbytes = n * 2

        def ag():
            comm_a.all_gather_flat(full, shard)

        def rs():
            comm_a.reduce_scatter_flat(out, grads)

        def pair(c_ag, c_rs, s_ag, s_rs):
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

        t_ag, t_rs = timer(f"{mib:g}MiB_ag", ag), timer(f"{mib:g}MiB_rs", rs)
        bus = nbytes * (world - 1) / world
        row = {"mib": mib, "ag_ms": t_ag * 1e3, "ag_spread_ms": timer.spread(f"{mib:g}MiB_ag"),
               "rs_ms": t_rs * 1e3, "rs_spread_ms": timer.spread(f"{mib:g}MiB_rs"),
               "ag_busbw_gbs": bus / t_ag / 1e9, "rs_busbw_gbs": bus / t_rs / 1e9}
        line = (f"{mib:7g} MiB  AG {row['ag_ms']:7.3f} ms ({row['ag_busbw_gbs']:6.1f} GB/s)  "
                f"RS {row['rs_ms']:7.3f} ms ({row['rs_busbw_gbs']:6.1f} GB/s)")
        if use_cuda:  # the stream pair: AG and RS issued together on one vs two communicators
            s_ag, s_rs = torch.cuda.Stream(), torch.cuda.Stream()
            t_one = timer(f"{mib:g}MiB_pair_one_comm", pair(comm_a, comm_a, s_ag, s_rs))
            t_two = timer(f"{mib:g}MiB_pair_two_comms", pair(comm_a, comm_b, s_ag, s_rs))
            row.update({"pair_one_comm_ms": t_one * 1e3, "pair_one_comm_spread_ms": timer.spread(f"{mib:g}MiB_pair_one_comm"),
                        "pair_two_comms_ms": t_two * 1e3,
                        "pair_two_comms_spread_ms": timer.spread(f"{mib:g}MiB_pair_two_comms"),
                        "two_vs_one": t_two / t_one})
            line += f"  AG||RS one comm {t_one * 1e3:7.3f} ms, two comms {t_two * 1e3:7.3f} ms ({t_two / t_one:.2f}x)"
        if args.registered and use_cuda:
            row["registered"] = registered_row(comm_a, dist.distributed_c10d._get_default_group(), n, timer, world,
                                               rank, mib)
            reg = row["registered"]
            if isinstance(reg.get("group"), dict):
                c, g = reg["caching"], reg["group"]
                grid = lambda r, k: max((v["max_grid_blocks"] for v in r[k].values()), default=0)
                line += (f"\n{'':13}in place: AG {c['ag_ms']:.3f} -> {g['ag_ms']:.3f} ms (grid {grid(c, 'ag_kernels')}"
                         f" -> {grid(g, 'ag_kernels')}), RS {c['rs_ms']:.3f} -> {g['rs_ms']:.3f} ms (grid "
                         f"{grid(c, 'rs_kernels')} -> {grid(g, 'rs_kernels')}) registered")
        rows.append(row)
        if rank == 0:
            print(line + "  (medians, slowest rank)", flush=True)
    uneven = uneven_rows(comm_a, [float(x) for x in args.uneven_mib.split(",") if x], timer, world, rank)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(run_meta(device), iters=args.iters, warmup=args.warmup,
                    timing="per iteration the slowest rank (all-reduce MAX); *_ms = median over iterations")
        (out / "comm.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "uneven": uneven, "raw_ms": timer.raw_ms}, indent=1))
        print(f"wrote {out / 'comm.json'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
