"""Compute lost to communication that runs beside it, by NCCL buffer kind and CTA policy.

    torchrun --nproc_per_node=2 benchmarks/probe_overlap_comm.py --out benchmarks/out/overlap

An FSDP step hides its all-gathers and reduce-scatters behind compute, but NCCL runs each
collective as kernels on SMs the compute then lacks (24 of an H200's 132 in RESULTS 16).
What decides the step is not the collective's time alone but how much it slows the
matmuls beside it. For each CTA policy the installed torch can set on a communicator
(default; "efficiency"; "zero": copy engines where NCCL can), each also with the group's
stream at high priority ("+hp"), and each buffer kind (torch's
caching allocator; the group's registered pool, Backend.allocate_tensor; symmetric memory
windows, torch.distributed._symmetric_memory's NCCL pool plus rendezvous), this times:
  - the in-place all-gather (input = this rank's segment of the output) and the
    reduce-scatter, alone on a side stream;
  - a bf16 GEMM loop alone on the compute stream, sized to last about as long;
  - both at once: the GEMM loop's time beside the collectives, and theirs beside it;
  - the kernels and copies one collective issues (torch.profiler): NCCL kernels with their
    grid (one SM per block), and memcpy activity (the copy-engine path);
and checks every gathered and reduced value. Slowest rank, median over --rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import run_meta  # noqa: E402


def _policies():
    """{name: ProcessGroupNCCL.Options or None} for the CTA policies this torch can set,
    each also as "<policy>+hp": the group's NCCL stream at high priority, so the
    collectives' kernels take SMs ahead of the compute's as they free up."""
    pg_cls = getattr(dist, "ProcessGroupNCCL", None)
    out = {"default": None}
    for name in ("DEFAULT", "EFFICIENCY", "ZERO"):
        value = getattr(pg_cls, f"NCCL_CTA_POLICY_{name}", None)
        if value is None:
            continue
        for high in (False, True):
            opts = pg_cls.Options(is_high_priority_stream=high)
            try:
                opts.config.cta_policy = value
            except AttributeError:
                continue
            if name != "DEFAULT" or high:
                out[name.lower() + ("+hp" if high else "")] = opts
    return out


class Buffers:
    """Allocates a collective's buffers of one kind for one group."""

    def __init__(self, kind: str, group, device):
        self.kind, self.group, self.device = kind, group, device

    def empty(self, numel: int, dtype) -> torch.Tensor:
        if self.kind == "caching":
            return torch.empty(numel, dtype=dtype, device=self.device)
        if self.kind == "registered":
            backend = self.group._get_backend(self.device)
            if not backend.supports_tensor_alloc(self.device):
                raise RuntimeError("the group's backend does not allocate tensors")
            return backend.allocate_tensor(numel, dtype=dtype, device=self.device)
        import torch.distributed._symmetric_memory as symm_mem
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(self.device)):
            t = torch.empty(numel, dtype=dtype, device=self.device)
        symm_mem.rendezvous(t, group=self.group.group_name)
        return t


def _elapsed(start, end) -> float:
    end.synchronize()
    return start.elapsed_time(end)


def _slowest(ms: float, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _profile(fn) -> dict:
    """NCCL kernels (name, grid) and memcpy activity of one call."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, copies = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if "nccl" in name.lower():
            kernels.append(name[:80])
        elif "memcpy" in name.lower() or "memset" in name.lower():
            copies.append(name[:60])
    grids = []
    try:  # the grid is in the trace's kernel args
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        for ev in trace.get("traceEvents", []):
            if ev.get("cat") == "kernel" and "nccl" in ev.get("name", "").lower():
                grids.append(ev.get("args", {}).get("grid"))
    except Exception as e:  # noqa: BLE001 - the grid is extra information
        grids.append(f"unavailable: {e}")
    return {"nccl_kernels": sorted(set(kernels)), "grids": grids[:4], "copies": len(copies),
            "copy_kinds": sorted(set(copies))[:4]}


def measure(group, buffers: Buffers, ag_numel: int, rs_numel: int, gemm: tuple, iters: int, rounds: int) -> dict:
    device = buffers.device
    world, rank = group.size(), group.rank()
    ag_out = buffers.empty(ag_numel, torch.bfloat16)
    rs_in = buffers.empty(rs_numel, torch.float32)
    rs_out = buffers.empty(rs_numel // world, torch.float32)
    seg = ag_numel // world
    ag_in = ag_out.narrow(0, rank * seg, seg)
    side = torch.cuda.Stream(device)

    def collectives():
        dist.all_gather_into_tensor(ag_out, ag_in, group=group)
        dist.reduce_scatter_tensor(rs_out, rs_in, group=group)

    # Values first: every rank's segment gathered, the reduction summed. The loops below
    # launch nothing but the collectives (a fill kernel beside a GEMM would wait for SMs
    # and time itself, not the collective).
    ag_in.fill_(rank + 1)
    rs_in.fill_(rank + 1)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        collectives()
    side.synchronize()
    expect = torch.arange(1, world + 1, device=device, dtype=torch.bfloat16).repeat_interleave(seg)
    values_ok = bool(torch.equal(ag_out, expect)) and bool(torch.all(rs_out == world * (world + 1) / 2))

    a, b = (torch.randn(gemm[0], gemm[1], device=device, dtype=torch.bfloat16),
            torch.randn(gemm[1], gemm[2], device=device, dtype=torch.bfloat16))
    c = torch.empty(gemm[0], gemm[2], device=device, dtype=torch.bfloat16)

    def comm_loop(n):
        with torch.cuda.stream(side):
            for _ in range(n):
                collectives()

    def gemm_loop(n):
        for _ in range(n):
            torch.mm(a, b, out=c)

    def timed(fn, stream):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(stream)
        fn()
        e.record(stream)
        return s, e

    comm_loop(2)
    gemm_loop(3)
    torch.cuda.synchronize()
    s, e = timed(lambda: comm_loop(iters), side)
    comm_alone = _slowest(_elapsed(s, e), device)
    s, e = timed(lambda: gemm_loop(10), torch.cuda.current_stream())
    per_gemm = _elapsed(s, e) / 10
    n_gemm = max(4, int(round(comm_alone / per_gemm)))
    agreed = torch.tensor([n_gemm], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # every rank runs the same loops
    n_gemm = int(agreed.item())

    rows = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        s, e = timed(lambda: gemm_loop(n_gemm), torch.cuda.current_stream())
        gemm_alone = _slowest(_elapsed(s, e), device)
        s, e = timed(lambda: comm_loop(iters), side)
        comm_alone_r = _slowest(_elapsed(s, e), device)
        torch.cuda.synchronize()
        dist.barrier(group=group)
        # Both at once: the collectives launched first on the side stream, then the GEMMs.
        cs, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cs.record(side)
        comm_loop(iters)
        ce.record(side)
        gs.record(torch.cuda.current_stream())
        gemm_loop(n_gemm)
        ge.record(torch.cuda.current_stream())
        comm_beside = _slowest(_elapsed(cs, ce), device)
        gemm_beside = _slowest(_elapsed(gs, ge), device)
        # Both streams' work, from the first start to the last end: 1.0 x the longer alone
        # is perfect overlap, the sum of the two is none.
        both = _slowest(max(_elapsed(cs, ce), _elapsed(cs, ge)), device)
        rows.append(dict(gemm_alone=gemm_alone, comm_alone=comm_alone_r, gemm_beside=gemm_beside,
                         comm_beside=comm_beside, both=both))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    prof = _profile(lambda: comm_loop(1))
    return dict(values_ok=values_ok, n_gemm=n_gemm, iters=iters, rounds=rows, median=med,
                gemm_slowdown=med["gemm_beside"] / med["gemm_alone"],
                comm_slowdown=med["comm_beside"] / med["comm_alone"],
                overlap=med["both"] / max(med["gemm_alone"], med["comm_alone"]), profile=prof)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ag-mib", type=float, default=64, help="all-gather output, bf16")
    p.add_argument("--rs-mib", type=float, default=128, help="reduce-scatter input, fp32")
    p.add_argument("--gemm", default="8192,8192,8192")
    p.add_argument("--iters", type=int, default=20, help="collective pairs per timed loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="caching,registered,symmetric")
    p.add_argument("--policies", default="default,efficiency,zero")
    p.add_argument("--out", default="benchmarks/out/overlap")
    args = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if any(k == "symmetric" for k in args.kinds.split(",")):
        try:
            import torch.distributed._symmetric_memory as symm_mem
            symm_mem.set_backend("NCCL")
        except Exception as e:  # noqa: BLE001 - reported per row below
            print(f"symmetric memory backend: {e}", flush=True)
    available = _policies()
    gemm = tuple(int(x) for x in args.gemm.split(","))
    ag_numel = int(args.ag_mib * 2**20 / 2) // world * world
    rs_numel = int(args.rs_mib * 2**20 / 4) // world * world
    results = []
    for policy in args.policies.split(","):
        if policy not in available:
            results.append(dict(policy=policy, error="this torch cannot set it (no ProcessGroupNCCL.NCCL_CTA_POLICY_"
                                                     f"{policy.upper()} / Options.config.cta_policy)"))
            continue
        opts = available[policy]
        group = dist.new_group(list(range(world)), pg_options=opts) if opts is not None else dist.new_group(
            list(range(world)))
        dist.all_reduce(torch.ones(1, device=device), group=group)  # the communicator exists from here
        for kind in args.kinds.split(","):
            row = dict(policy=policy, kind=kind)
            try:
                row.update(measure(group, Buffers(kind, group, device), ag_numel, rs_numel, gemm, args.iters,
                                   args.rounds))
            except Exception as e:  # noqa: BLE001 - one kind failing must not hide the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(row)
            if rank == 0:
                if "error" in row:
                    print(f"{policy:>10} {kind:>10}: {row['error']}", flush=True)
                else:
                    m = row["median"]
                    print(f"{policy:>10} {kind:>10}: values {'ok' if row['values_ok'] else 'WRONG'}; comm alone "
                          f"{m['comm_alone']:.2f} ms, beside {m['comm_beside']:.2f}; gemm alone {m['gemm_alone']:.2f} "
                          f"ms, beside {m['gemm_beside']:.2f} (x{row['gemm_slowdown']:.3f}); both {m['both']:.2f} ms "
                          f"(x{row['overlap']:.3f} the longer alone); kernels "
                          f"{row['profile']['nccl_kernels']} grids {row['profile']['grids']} copies "
                          f"{row['profile']['copies']} {row['profile']['copy_kinds']}", flush=True)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = run_meta(device)
        meta.update(ag_mib=args.ag_mib, rs_mib=args.rs_mib, gemm=gemm,
                    env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
        (out / "overlap_comm.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
