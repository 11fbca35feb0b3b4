"""Size a job on one GPU: rank 0 of a world of W under torch's fake backend (collectives
return at once and move nothing), for ours (mfsdp), FSDP2 and `local` (the plain model,
no FSDP: the no-communication limit), each system in its own process, on the same lean
Llama-style model (the bench model): built on the meta device and materialized (local:
built directly), bf16 compute, fp32 master weights and gradient reduction, fused AdamW.

    python benchmarks/simulate.py --points 13b@8,70b@64 --systems mfsdp,fsdp2 --out runs/sim
    python benchmarks/simulate.py --points 70b@64,256 --tp 8 --out runs/sim_tp8   # FSDP x TP 8

Per system and point it measures, on this GPU: init time and init peak, the steady peak
(max over the steps after the first), the step time (CUDA events; forward, backward and
optimizer separately; each step ends with a device synchronize), collectives per step by
kind with their bytes (both systems counted the same way, from the process group's own
dispatcher calls in a profiled step; ours also by its own counters), and for ours
estimate_memory's prediction against a measured peak. The numbers hold no communication
time: see benchmarks/project.py for a labelled projection. A config with "/L" after it
(70b/4@64) keeps the layer shapes and uses L layers: the depth-reduced copy on which
local fits. With --tp T the model is tensor-parallel over T of the W ranks (the library's
models.tensor_parallel: torchtitan's plan, sequence parallel on) on a (W/T, T) mesh and
both FSDPs shard over the W/T data-parallel ranks; TP's own collectives are fake too.
With --fp8 the blocks' linear layers are torchao Float8Linear (tensorwise scaling):
"tensorwise" gathers their weights in bf16, "tensorwise_gather" in FP8 (ours: our gather
transform; FSDP2: torchao's fsdp_pre/post_all_gather, with
precompute_float8_dynamic_scale_for_fsdp after each optimizer step; local: no gather).
With --compile every block is compiled (inductor) after sharding (local: after building),
as torchao's FP8 recipes expect.
With --experts N the blocks' MLPs are N routed SwiGLU experts (megatron_fsdp_ext.models.
MoEModel: top --top-k routing, each expert ffn / top-k wide, fixed capacity), and with
--ep E they are expert-parallel over E of the W ranks (a (W/E, E) "efsdp" x "ep" mesh, the
tokens exchanged by all-to-all, fake too): dense parameters shard over all W ranks, the
experts over the W/E expert data-parallel ranks, for both FSDPs as FSDP2 does it on this
torch (shard_placement_fn with ShardPlacementResult from torch 2.12; before it, the
experts as a unit of their own on that mesh, torchtitan 0.2's form): "moe_form" in the
results says which. Without --ep the experts shard with the dense parameters, off dim 0
where W exceeds the experts (torchtitan's ep_degree == 1 rule, expert_placement_fn). local
runs the same MoE model whole, without expert parallelism.
Every system routes by the same fixed, balanced pattern (moe_setup.balanced_routing): a
fake gather repeats the local shard, so each system's router would route by its own shard
layout, and the activations sized by the routing would differ between the systems.

    python benchmarks/simulate.py --points moe_1b@8,64 --experts 16 --ep 8 --out runs/sim_ep8
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from moe_setup import (FORMS, balanced_routing, check_ep, expert_parallel_meshes, expert_placement_fn,  # noqa: E402
                       moe_config, routing_kept_fraction, shard_moe_blocks)

# name: shape (benchmarks/shapes.py). "8b" is the 32-layer d 4096 shape (6.7B), the name
# earlier results use.
CONFIGS = {
    "small_many": shapes.SMALL_MANY,
    "1.3b": shapes.LLAMA_1_3B,
    # bench_train.py's names, so a projection lines up with the measured step of that config
    "1b": shapes.LLAMA_1_3B,
    "1b_comm_bound": shapes.LLAMA_1_3B._replace(micro_batch=1, seq=512),
    "8b": shapes.LLAMA_7B,
    "13b": shapes.LLAMA_13B,
    "70b": shapes.LLAMA_70B,
    "405b": shapes.LLAMA_405B,
    "tiny": shapes.TINY._replace(layers=2),
    "moe_1b": shapes.LLAMA_1_3B,  # with --experts: the 1.3B shape's blocks with routed experts
}
SYSTEMS = ("mfsdp", "fsdp2", "local")
DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
               "unsigned char": 1, "signed char": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
FP8_MODES = ("none", "tensorwise", "tensorwise_gather")


def parse_link(text: str):
    """--link: "ALPHA_US:GBPS" or a link_probe.py JSON file -> megatron_fsdp_ext.link.LinkModel."""
    from megatron_fsdp_ext.link import LinkModel
    if Path(text).is_file():
        found = json.loads(Path(text).read_text())["measurements"]
        return LinkModel(alpha_s=statistics.median(m["alpha_s"] for m in found),
                         bytes_per_s=statistics.median(m["bytes_per_s"] for m in found))
    alpha_us, sep, gbps = text.partition(":")
    try:
        return LinkModel(alpha_s=float(alpha_us) * 1e-6, bytes_per_s=float(gbps) * 1e9)
    except ValueError as e:
        raise SystemExit(f"--link {text!r}: expected ALPHA_US:GBPS (e.g. 40:500) or a link_probe.py JSON ({e})")


def parse_config(text: str):
    """'70b' or '70b/4' (4 layers of 70b's shape) -> (name, tuple)."""
    name, _, layers = text.partition("/")
    if name not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
    vocab, d, n_layers, heads, ffn, mb, seq = CONFIGS[name]
    return (vocab, d, int(layers) if layers else n_layers, heads, ffn, mb, seq)


# ------------------------------------------------------------------------------ child

# Element sizes of what each collective carries under the simulated policy (bf16
# parameters gathered, fp32 gradients reduced), for profilers that record no dtypes.
POLICY_BYTES = {"allgather": 2, "reduce_scatter": 4, "allreduce": 4}


def _c10d_calls(prof) -> dict:
    """Per c10d dispatcher op of a profiled step: calls and bytes of its whole buffer
    (all-gather output, reduce-scatter input, all-reduce tensor), from the recorded shapes
    and dtypes (torch 2.13) or, where the profiler records no dtypes (torch 2.11), the
    policy's element size for that kind of collective; None for tensor lists."""
    out = {}
    for e in prof.events():
        if not e.name.startswith("c10d::"):
            continue
        shapes = [s for s in (e.input_shapes or []) if s]
        dtypes = getattr(e, "input_dtypes", None) or []
        nbytes = None
        if shapes:
            numel = max(_numel(s) for s in shapes)
            size = next((DTYPE_BYTES[t] for t in dtypes if t in DTYPE_BYTES), None)
            if size is None:
                size = next((b for k, b in POLICY_BYTES.items() if k in e.name), None)
            nbytes = None if size is None else numel * size
        calls, total = out.get(e.name, (0, 0))
        out[e.name] = (calls + 1, None if total is None or nbytes is None else total + nbytes)
    return out


def _kernel_summary(prof, top: int) -> dict:
    """The profiled step's GPU kernels: how long the GPU was busy (the union of kernel
    intervals) against the span from the first kernel's start to the last one's end, and
    the `top` kernel names by summed time (count, ms). Under the fake backend every
    kernel is compute, a copy or a cast: the span minus the busy time is the GPU waiting
    on the host."""
    from torch.autograd import DeviceType

    from megatron_fsdp_ext.tools.trace import union_length
    kernels, by_name = [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        kernels.append((e.name, None, start, end))
        count, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, us + (end - start))
    if not kernels:
        return {"kernels": 0}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    span = max(k[3] for k in kernels) - min(k[2] for k in kernels)
    return {"kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": union_length(kernels) / 1e3,
            "kernel_sum_ms": sum(us for _, us in by_name.values()) / 1e3,
            "top": [{"name": name[:160], "count": c, "ms": us / 1e3} for name, (c, us) in ranked]}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Clock:
    """Event timing on CUDA (recorded on the stream), host time on the CPU (a smoke run)."""

    def __init__(self, cuda: bool):
        import torch
        self.cuda = cuda
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self):
        if self.cuda:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, later: "_Clock") -> float:
        return self.event.elapsed_time(later.event) if self.cuda else (later.t - self.t) * 1e3


def child(args) -> None:
    """One system and config at each of args.worlds, in this one process (the process
    group is made again for each world); results are written after each world."""
    import gc

    import torch
    import torch.distributed as dist

    results = []
    for world in args.worlds:
        try:
            results.append(measure(args, world))
        except torch.OutOfMemoryError:
            results.append({"system": args.system, "config": args.config, "world": world, "error": "out of memory"})
        dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        Path(args.json).write_text(json.dumps(results, indent=1))


def measure(args, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import megatron_fsdp_ext as mfsdp
    from megatron_fsdp_ext import _C
    from megatron_fsdp_ext.models import LlamaConfig, LlamaModel, MoEModel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.peak_breakdown and cuda:  # from before the build: every block alive at the peak has its stack
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=world)
    vocab, d, layers, heads, ffn, mb, seq = parse_config(args.config)
    link_model = parse_link(args.link) if args.link and args.system == "mfsdp" else None
    if args.experts:
        cfg = moe_config((vocab, d, layers, heads, ffn, mb, seq), args.experts, args.top_k)
        Model = MoEModel
    else:
        cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn, max_seq_len=seq)
        Model = LlamaModel
    with torch.device("meta"):
        shapes = Model(cfg)
    params = sum(p.numel() for p in shapes.parameters())
    largest = max(p.numel() for p in shapes.parameters())
    del shapes
    def sync():
        if cuda:
            torch.cuda.synchronize()

    def reset_peak():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else 0

    def tp_split(meta_model):
        """With --tp: the model tensor-parallel on the (W/T, T) mesh's "tp" dim; returns
        the data-parallel mesh (None without TP)."""
        if args.tp == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        from megatron_fsdp_ext.models import tensor_parallel
        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
        tensor_parallel(meta_model, mesh["tp"])
        return mesh["dp_shard"]

    check_ep(args.ep, args.experts, world)
    if args.ep > 1 and (args.tp > 1 or args.fp8 != "none"):
        raise SystemExit(f"--ep {args.ep} does not combine with --tp or --fp8")
    if args.tp > 1 and (world % args.tp or args.system == "local"):
        raise SystemExit(f"--tp {args.tp}: needs a world it divides and an FSDP system (not local)")
    if args.tp > 1 and args.fp8 == "tensorwise_gather":
        raise SystemExit("--fp8 tensorwise_gather does not combine with --tp")

    def to_fp8(m):
        """The blocks' linear layers as torchao Float8Linear (--fp8); the output head stays."""
        if args.fp8 == "none":
            return m
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        gather = args.fp8 == "tensorwise_gather" and args.system != "local"
        return convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather),
                                          module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    torch.manual_seed(0)
    sync()
    reset_peak()
    t0 = time.perf_counter()
    autocast = False
    moe_form = None
    if args.system == "local":
        with torch.device(device):  # fp32 weights, bf16 compute under autocast (as bench_train)
            model = to_fp8(Model(cfg))
        autocast = True
    elif args.system == "mfsdp":
        with torch.device("meta"):
            model = to_fp8(Model(cfg))
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.ep > 1:
            moe_form = shard_moe_blocks(model, mfsdp.fully_shard, *expert_parallel_meshes(model, device.type, world, args.ep),
                                        args.moe_form, mp_policy=mp)
        else:
            dp_mesh = tp_split(model)
            placement = expert_placement_fn(model, world // args.tp)
            for block in model.blocks:
                mfsdp.fully_shard(block, mp_policy=mp, mesh=dp_mesh, shard_placement_fn=placement)
            mfsdp.fully_shard(model, mp_policy=mp, mesh=dp_mesh)
        if link_model is not None:  # plan the "auto" buckets as on the machine whose link this is
            model.set_link_model(link_model)
        mfsdp.materialize(model)
    elif args.system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        with torch.device("meta"):
            model = to_fp8(Model(cfg))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.ep > 1:
            moe_form = shard_moe_blocks(model, fully_shard, *expert_parallel_meshes(model, device.type, world, args.ep),
                                        args.moe_form, mp_policy=mp)
        else:
            mesh = tp_split(model) or init_device_mesh(device.type, (world,))
            placement = expert_placement_fn(model, world // args.tp)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device=device)
        with torch.no_grad():
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    else:
        raise SystemExit(f"unknown system {args.system!r}")
    if args.experts:  # the gathered router weights are the local shard repeated (see balanced_routing)
        balanced_routing(model)
    if args.compile:
        for block in model.blocks:
            block.compile()
    sync()
    init_s = time.perf_counter() - t0
    init_peak = peak()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (mb, seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1], data[:, 1:]

    def step(toks=tokens, tgts=targets, events=None):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(toks)
        if events:
            events[1].record()
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tgts.reshape(-1))
        loss.backward()
        if events:
            events[2].record()
        opt.step()
        if precompute_fp8:  # FSDP2 + torchao's FP8 gather: the scales for the next gathers
            precompute_fp8(model)
        opt.zero_grad(set_to_none=True)

    precompute_fp8 = None
    if args.system == "fsdp2" and args.fp8 == "tensorwise_gather":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute_fp8
    rows, peaks = [], []
    for i in range(args.warmup + args.steps):
        ev = [_Clock(cuda) for _ in range(4)]
        reset_peak()
        ev[0].record()
        step(events=ev)
        ev[3].record()
        sync()  # the clock stops once all launched work is done
        peaks.append(peak())
        if i >= args.warmup:
            rows.append({"step_ms": ev[0].ms_until(ev[3]), "forward_ms": ev[0].ms_until(ev[1]),
                         "backward_ms": ev[1].ms_until(ev[2]), "optimizer_ms": ev[2].ms_until(ev[3])})
    breakdown = None
    if args.peak_breakdown and cuda:  # the allocator's trace ends here: the profiled step is not in it
        from megatron_fsdp_ext.tools.memory import large_events_to, live_at_peak

        snapshot = torch.cuda.memory._snapshot()
        peak_bytes, at, groups = live_at_peak(snapshot)
        breakdown = {"peak_bytes": peak_bytes, "at_event": at,
                     "groups": [{"origin": o, "blocks": c, "bytes": b} for o, c, b in groups[:args.peak_breakdown]],
                     "large_events_to_peak": large_events_to(snapshot, at)}
        torch.cuda.memory._record_memory_history(enabled=None)
    before = dict(_C.collective_counts())
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda and args.kernels else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
    sync()
    kernels = _kernel_summary(prof, args.kernels) if cuda and args.kernels else None
    try:
        c10d_calls = _c10d_calls(prof)
    except Exception as e:  # a profiler API this torch lacks must not cost the timings
        c10d_calls = {"error": repr(e)}
    after = dict(_C.collective_counts())
    ours = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after if after[k] != before[k]}
    # Last, so that nothing measured includes it: one forward without grad counts the kept routing pairs.
    kept = routing_kept_fraction(model, lambda: model(tokens), device.type, autocast) if args.experts else None
    result = {
        "system": args.system, "config": args.config, "world": world, "rank": args.rank, "params": params,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "layers": layers, "micro_batch": mb, "seq": seq, "tp": args.tp, "fp8": args.fp8, "compile": args.compile,
        "experts": args.experts, "top_k": args.top_k if args.experts else None, "ep": args.ep, "moe_form": moe_form,
        "routing_kept_fraction": kept, "init_s": init_s, "init_peak_gib": init_peak / 2**30,
        "first_step_peak_gib": peaks[0] / 2**30, "steady_peak_gib": max(peaks[1:], default=peaks[0]) / 2**30,
        "step_ms": statistics.median(r["step_ms"] for r in rows),
        "step_ms_min": min(r["step_ms"] for r in rows), "step_ms_max": max(r["step_ms"] for r in rows),
        "forward_ms": statistics.median(r["forward_ms"] for r in rows),
        "backward_ms": statistics.median(r["backward_ms"] for r in rows),
        "optimizer_ms": statistics.median(r["optimizer_ms"] for r in rows),
        "bucket_budgets": list(model.bucket_budgets()) if args.system == "mfsdp" else None,
        "link_model": dataclasses.asdict(link_model) if link_model is not None else None,
        "steps": rows, "c10d_calls_per_step": c10d_calls, "our_counts_per_step": ours,
        "largest_param_gib": largest * 4 / 2**30,
        "kernels_in_profiled_step": kernels,
        "peak_breakdown": breakdown,
    }
    if args.system == "mfsdp" and args.tp == 1:  # estimate_memory does not model TP
        # estimate_memory leaves activations out: its prediction is checked against a
        # step on one sequence of 128 tokens, where what activations remain is small.
        with torch.device("meta"):
            meta = to_fp8(Model(cfg))
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        moe = {}
        if args.experts:
            expert_params = {id(p) for b in meta.blocks for p in b.moe.experts.parameters()}
            moe = {"experts": lambda p: id(p) in expert_params, "expert_parallel": args.ep}
        est = mfsdp.estimate_memory(meta, world, unit_modules=[type(meta.blocks[0])], mp_policy=mp,
                                    optimizer="adamw", **moe)
        sync()
        reset_peak()
        step(tokens[:1, :128], targets[:1, :128])
        sync()
        small_peak = peak()
        result.update(estimate_gib=est.total / 2**30, small_step_peak_gib=small_peak / 2**30,
                      estimate_over_measured=est.total / small_peak if small_peak else None,
                      estimate_components_gib={k: getattr(est, k) / 2**30 for k in (
                          "params", "grads", "optimizer_state", "gathered_params", "reduction_buffers")})
    return result


# ------------------------------------------------------------------------------ parent

def run_system(system: str, config: str, worlds, args) -> list:
    """`system` on `config` at every world in `worlds`, in a process of its own."""
    tag = (f"_tp{args.tp}" if args.tp > 1 else "") + (f"_fp8-{args.fp8}" if args.fp8 != "none" else "") + \
        ("_compiled" if args.compile else "") + (f"_moe{args.experts}" if args.experts else "") + \
        (f"_ep{args.ep}" if args.ep > 1 else "")
    out = Path(args.out) / f"{system}_{config.replace('/', '-')}{tag}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", "--system", system, "--config", config,
           "--worlds", ",".join(map(str, worlds)), "--rank", str(args.rank), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--tp", str(args.tp), "--fp8", args.fp8, "--json", str(out)] + \
        (["--compile"] if args.compile else []) + (["--link", args.link] if args.link else []) + \
        ["--experts", str(args.experts), "--top-k", str(args.top_k), "--ep", str(args.ep), "--moe-form", args.moe_form,
         "--kernels", str(args.kernels), "--peak-breakdown", str(args.peak_breakdown)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    results = json.loads(out.read_text()) if out.exists() else []
    done = {r["world"] for r in results}
    for world in worlds:
        if world not in done:  # the process died first: say how
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            results.append({"system": system, "config": config, "world": world, "error": tail})
    for r in results:
        if "error" in r:
            print(f"  {system:6s} {config:10s} W={r['world']:5d}: {r['error'].splitlines()[-1][:120]}", flush=True)
        else:
            print(f"  {system:6s} {config:10s} fp8={args.fp8:17s} W={r['world']:5d}: step {r['step_ms']:8.1f} ms, steady peak "
                  f"{r['steady_peak_gib']:6.2f} GiB, init {r['init_s']:5.1f} s / {r['init_peak_gib']:6.2f} GiB",
                  flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="small_many@8 1.3b@8",
                   help="space-separated config@world[,world...] items, e.g. '70b@64,256 13b/4@8'")
    p.add_argument("--systems", default="mfsdp,fsdp2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rank", type=int, default=0, help="the rank the process plays")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (a (W/T, T) mesh)")
    p.add_argument("--compile", action="store_true", help="compile every block (inductor) after sharding")
    p.add_argument("--experts", type=int, default=0, help="routed experts per block (0: the dense model)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to (with --experts)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a (W/E, E) efsdp x ep mesh)")
    p.add_argument("--moe-form", choices=FORMS, default="auto",
                   help="how experts get their mesh (auto: shard_placement_fn where torch has ShardPlacementResult)")
    p.add_argument("--fp8", choices=FP8_MODES, default="none",
                   help="torchao Float8Linear blocks: bf16 weight gather (tensorwise) or FP8 (tensorwise_gather)")
    p.add_argument("--link", help="plan our \"auto\" buckets from this link instead of none (nothing moves "
                   "under the fake backend): ALPHA_US:GBPS (all-gather output GB/s), or a benchmarks/link_probe.py "
                   "JSON (the median of its measurements)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile the GPU in the profiled step: busy time against span, and the N "
                   "kernels that took the most time")
    p.add_argument("--peak-breakdown", type=int, default=0, metavar="N",
                   help="record the allocator's trace from before the build and report the N largest groups "
                   "of blocks alive at its peak, by allocation site (tools.memory.live_at_peak; the steps are "
                   "slower then: not for timing)")
    p.add_argument("--out", default="runs/simulate")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--worlds", type=lambda v: [int(w) for w in v.split(",")], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.link:
        parse_link(args.link)  # a bad --link fails here, not in every child
    Path(args.out).mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {SYSTEMS}")
    results = []
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "commit": os.environ.get("MFSDP_COMMIT"),
            "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            "backend": f"fake (rank {args.rank} of W, one process per system and config)", "tp": args.tp,
            "fp8": args.fp8, "compile": args.compile,
            "steps": f"{args.warmup} warm-up + {args.steps} timed (median), then 1 profiled step"}
    for item in args.points.split():
        config, _, worlds = item.partition("@")
        parse_config(config)
        for system in systems:
            results += run_system(system, config, [int(w) for w in worlds.split(",")], args)
            (Path(args.out) / "simulate.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
