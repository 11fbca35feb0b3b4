"""Training-step benchmark: megatron_fsdp_ext vs FSDP2 (torch fully_shard) vs DDP, in one
run, on the same model and data.

    torchrun --nproc_per_node=2 benchmarks/bench_train.py --configs 1b,1b_comm_bound,small_many,8b_ish

Each system trains the Llama-style model for --warmup + --steps steps with bf16
compute, fp32 gradient reduction and fused AdamW (DDP: fp32 parameters under bf16
autocast). Reports the median step time, tokens/s/GPU, TFLOP/s/GPU and peak memory,
and the ratios against FSDP2 (compiled FSDP2 for compiled rows) and DDP; writes results.json, results.md and a step-time
PNG under --out. `--device cpu --configs tiny` runs the same code on Gloo (a smoke run,
not a measurement). `--meta-init` builds mfsdp, fsdp2 and megatron_fsdp on the meta device (needed for
the 13b config, which does not fit one GPU) and records init time, init peak and the
local shard size; `--systems mfsdp,fsdp2 --configs 13b --meta-init` is the run for a
model that needs FSDP.
`--experts N` makes every config a mixture of experts (megatron_fsdp_ext.models.MoEModel:
each block's MLP N routed SwiGLU experts, top --top-k); `--ep E` adds expert parallelism
(experts as DTensors on the "ep" dim of a (W/E, E) mesh, tokens exchanged by all-to-all),
both FSDPs sharding the experts over the expert data-parallel mesh as FSDP2 does it on
this torch (benchmarks/moe_setup.py), and `local` running the whole MoE on each GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel, MoEConfig, MoEModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_meta import init_benchmark_process, run_meta  # noqa: E402
import shapes  # noqa: E402
from moe_setup import (FORMS, balanced_routing, check_ep, expert_parallel_meshes, moe_config,  # noqa: E402
                       routing_kept_fraction, shard_moe_blocks)

# name: shape (benchmarks/shapes.py: vocab, d_model, layers, heads, ffn, micro_batch, seq)
CONFIGS = {
    "1b": shapes.LLAMA_1_3B,
    "1b_comm_bound": shapes.LLAMA_1_3B._replace(micro_batch=1, seq=512),
    "small_many": shapes.SMALL_MANY,
    "8b_ish": shapes.LLAMA_7B._replace(layers=16, micro_batch=2),  # 3.5B
    "tiny": shapes.TINY,
    # ZeRO-3 over two H200s needs ~102 GB a rank plus activations; --meta-init builds it
    # on the meta device, so it never exists whole on any rank.
    "13b": shapes.LLAMA_13B,
}
# "<system>_compiled": each block compiled (torch.compile, inductor) after sharding.
# "<system>_graphed": the whole training step (forward, backward with its collectives, a
# capturable fused AdamW step) captured once in a CUDA graph after warm-up and replayed.
# "mfsdp_bucketed": ours with gather_bucket_bytes=32 MiB and reduce_bucket_bytes=64 MiB
# (consecutive blocks share one all-gather and one reduce-scatter; fp32 gradients take
# twice the bytes of bf16 parameters, so both group the same blocks).
# "mfsdp": ours with defaults (bucket budgets "auto": from the link timed after the first
# backward); "mfsdp_unbucketed": one collective per unit (gather/reduce_bucket_bytes=0).
SYSTEMS = ("mfsdp", "mfsdp_unbucketed", "fsdp2", "ddp", "local", "megatron_fsdp", "megatron_fsdp_ag", "mfsdp_compiled",
           "fsdp2_compiled", "mfsdp_graphed", "local_graphed", "mfsdp_bucketed", "mfsdp_bucketed_graphed",
           "mfsdp_nancheck", "mfsdp_ub", "mfsdp_unbucketed_ub", "fsdp2_ub", "mfsdp_one_comm")
# "mfsdp_nancheck": ours with check_for_nan_in_grad=True (its cost against "mfsdp").
# "mfsdp_one_comm": ours with create_all_gather_group=False: all-gathers and reduce-scatters
# on one communicator, so they run one at a time as FSDP2's do, against "mfsdp", whose
# all-gathers have a communicator of their own (on NCCL) and can run beside a
# reduce-scatter, each taking its own SMs from the compute.
# "<system>_ub": every unit's all-gather output and reduce-scatter input allocated by the
# process group (set_allocate_memory_from_process_group_for_comm(True); NCCL: registered
# memory the collectives run on in place), against the same system without.
# Our eager variants: one build path, each may start from the meta device.
MFSDP_EAGER = ("mfsdp", "mfsdp_unbucketed", "mfsdp_bucketed", "mfsdp_nancheck", "mfsdp_one_comm")
GATHER_BUCKET_BYTES = 32 << 20
REDUCE_BUCKET_BYTES = 64 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1b,1b_comm_bound,small_many,8b_ish")
    p.add_argument("--systems", default="mfsdp,fsdp2,ddp", help=f"comma-separated, from {SYSTEMS}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--timeline", default="1b_comm_bound",
                   help="configs (comma-separated) whose last step is profiled into timeline_<system>_<config>.png and "
                        "the NCCL kernel summary (CUDA only; '' = none)")
    p.add_argument("--meta-init", action="store_true",
                   help="mfsdp, fsdp2 and megatron_fsdp build the model on the meta device and initialize only "
                        "their shards (mfsdp: materialize(); fsdp2: to_empty() + reset_parameters(); megatron_fsdp: "
                        "its init_model_with_meta_device); ddp and local are refused")
    p.add_argument("--memory-snapshot", default="",
                   help="config whose allocations are recorded (CUDA only) into memory_<system>_<config>.pickle "
                        "for python -m megatron_fsdp_ext.tools.memory")
    p.add_argument("--experts", type=int, default=0, help="routed experts per block (0: the dense model)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token is routed to (with --experts)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a (W/E, E) efsdp x ep mesh)")
    p.add_argument("--balanced-routing", action="store_true",
                   help="route every MoE layer by one fixed, balanced pattern (moe_setup.balanced_routing): "
                        "every system then holds the same activations, so their peaks compare without "
                        "the routing's variation between runs and systems")
    p.add_argument("--moe-form", choices=FORMS, default="auto",
                   help="how experts get their mesh (auto: shard_placement_fn where torch has ShardPlacementResult)")
    return p.parse_args()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2's DTensor


def _megatron_fsdp(model, device: torch.device, separate_all_gather_group: bool, meta_init: bool = False):
    """NVIDIA Megatron-FSDP from PyPI (`megatron-fsdp`), set up as its docs recommend for
    this comparison: a bf16 model, fp32 main parameters and gradients, one unit per block,
    ZeRO-3; `_ag` adds its separate all-gather group (fsdp_group_ag) so all-gathers
    overlap reduce-scatters, as ours and FSDP2 do by default on NCCL. With `meta_init` the
    model comes on the meta device and Megatron-FSDP's own deferred init
    (init_model_with_meta_device) allocates its buffers and calls each module's
    reset_parameters(), so a model that does not fit whole on one GPU can be compared."""
    if device.type != "cuda":
        raise SystemExit("megatron_fsdp runs on CUDA only")
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    # It looks parameters' tensor-parallel mesh up by name even without TP: a trivial tp dim.
    mesh = init_device_mesh("cuda", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    ag_group = dist.new_group(list(range(dist.get_world_size()))) if separate_all_gather_group else None
    mp = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    wrapped = megatron_fsdp.fully_shard_model(
        model.to(torch.bfloat16), device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
        fsdp_unit_modules=[type(model.blocks[0])],
        zero_dp_strategy=3, mixed_precision_policy=mp, fsdp_group_ag=ag_group, device=device,
        init_model_with_meta_device=meta_init)
    return wrapped, wrapped, False


def _init_fsdp2_shards(model, device: torch.device) -> None:
    """FSDP2's deferred init: allocate the DTensor shards, then each module's initializer."""
    model.to_empty(device=device)
    with torch.no_grad():
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


# With expert parallelism: the systems that place experts on their own mesh (local runs
# every expert itself, without expert parallelism).
EP_SYSTEMS = ("mfsdp", "mfsdp_unbucketed", "mfsdp_bucketed", "mfsdp_nancheck", "mfsdp_one_comm", "fsdp2", "local")


def build(system: str, cfg: LlamaConfig, device: torch.device, meta_init: bool = False, ep: int = 1,
          moe_form: str = "auto"):
    if system.endswith("_graphed"):
        if device.type != "cuda":
            raise SystemExit(f"{system}: CUDA graphs need a CUDA device")
        return build(system.removesuffix("_graphed"), cfg, device, meta_init, ep, moe_form)
    if system.endswith("_ub"):
        wrapped, model, autocast = build(system.removesuffix("_ub"), cfg, device, meta_init, ep, moe_form)
        for m in model.modules():
            if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                m.set_allocate_memory_from_process_group_for_comm(True)
        return wrapped, model, autocast
    if system.endswith("_compiled"):
        wrapped, model, autocast = build(system.removesuffix("_compiled"), cfg, device, meta_init, ep, moe_form)
        for block in model.blocks:  # the unit hooks stay outside the compiled graphs
            block.compile()
        return wrapped, model, autocast
    if meta_init and system not in MFSDP_EAGER + ("fsdp2", "megatron_fsdp", "megatron_fsdp_ag"):
        # ddp and local need the whole model on each rank
        raise ValueError(f"--meta-init: {system} cannot start from a model on the meta device")
    if ep > 1 and system not in EP_SYSTEMS:
        raise SystemExit(f"--ep {ep}: {system} does not place experts on their own mesh; use one of {EP_SYSTEMS}")
    torch.manual_seed(0)
    # Initialised on the GPU (an 8B model takes minutes on one CPU thread), or on meta.
    with torch.device("meta" if meta_init else device):
        model = (MoEModel if isinstance(cfg, MoEConfig) else LlamaModel)(cfg)
    bf16 = device.type == "cuda"
    expert_meshes = None
    if ep > 1 and system != "local":
        expert_meshes = expert_parallel_meshes(model, device.type, dist.get_world_size(), ep)
    if system in MFSDP_EAGER:
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else mfsdp.MixedPrecisionPolicy()
        unit_args = dict(mp_policy=mp, check_for_nan_in_grad=system == "mfsdp_nancheck")
        if system == "mfsdp_one_comm":
            unit_args["create_all_gather_group"] = False
        buckets = {"mfsdp_bucketed": dict(gather_bucket_bytes=GATHER_BUCKET_BYTES, reduce_bucket_bytes=REDUCE_BUCKET_BYTES),
                   "mfsdp_unbucketed": dict(gather_bucket_bytes=0, reduce_bucket_bytes=0)}.get(system, {})
        if expert_meshes is not None:
            model.moe_form = shard_moe_blocks(model, mfsdp.fully_shard, *expert_meshes, moe_form, **unit_args)
            if buckets:
                model.set_gather_bucket_bytes(buckets["gather_bucket_bytes"])
                model.set_reduce_bucket_bytes(buckets["reduce_bucket_bytes"])
        else:
            for block in model.blocks:
                mfsdp.fully_shard(block, **unit_args)
            mfsdp.fully_shard(model, **unit_args, **buckets)
        if meta_init:
            mfsdp.materialize(model)
        return model, model, False
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        if expert_meshes is not None:
            model.moe_form = shard_moe_blocks(model, fully_shard, *expert_meshes, moe_form, mp_policy=mp)
        else:
            # An explicit mesh: FSDP2's default mesh is CUDA whenever a GPU exists, even for a CPU run.
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        if meta_init:
            _init_fsdp2_shards(model, device)
        return model, model, False
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Gradients as views of DDP's buckets: no copy into and out of them (its fastest setting).
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
        return ddp, model, bf16  # autocast for bf16 compute
    if system in ("megatron_fsdp", "megatron_fsdp_ag"):
        return _megatron_fsdp(model, device, separate_all_gather_group=system.endswith("_ag"), meta_init=meta_init)
    if system == "local":
        # The no-communication limit: each rank trains its micro-batch alone, with the
        # same bf16 compute as DDP (autocast), no collective at all.
        return model, model, bf16
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def settle_previous_system() -> None:
    """Let the previous system's memory go before this one is measured: right after a
    DDP run up to 1.7 GiB was still allocated (2xH200) and counted in the next system's
    peak. Waits up to 5 s for it; what is left is reported as the baseline."""
    torch.cuda.synchronize()
    dist.barrier()
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        torch.cuda.empty_cache()
        if torch.cuda.memory_allocated() < 2**28 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    torch.cuda.reset_peak_memory_stats()


def run_one(system, name, device, args):
    vocab, d, layers, heads, ffn, mb, seq = CONFIGS[name]
    if args.experts:
        check_ep(args.ep, args.experts, dist.get_world_size())
        cfg = moe_config(CONFIGS[name], args.experts, args.top_k)
    else:
        if args.ep > 1:
            raise SystemExit(f"--ep {args.ep} needs --experts")
        cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn,
                          max_seq_len=seq)
    snapshot = device.type == "cuda" and args.memory_snapshot == name
    if device.type == "cuda":
        settle_previous_system()
        if snapshot:
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    # Left over from an earlier system would inflate this one's peak: reported, not hidden.
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    init_start = time.perf_counter()
    wrapped, model, autocast = build(system, cfg, device, args.meta_init, args.ep, args.moe_form)
    # The model with the MoE blocks (Megatron-FSDP returns its wrapper for both).
    inner = model if hasattr(model, "blocks") else getattr(model, "module", model)
    if args.balanced_routing:
        balanced_routing(inner)
    if device.type == "cuda":
        torch.cuda.synchronize()
        init_peak = torch.cuda.max_memory_allocated() - baseline
        torch.cuda.reset_peak_memory_stats()
    else:
        init_peak = 0
    init_s = time.perf_counter() - init_start
    graphed = system.endswith("_graphed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None, capturable=graphed)
    if system.startswith("megatron_fsdp"):  # its optimizer.step() finishes the gradient reductions
        import megatron_fsdp
        opt = megatron_fsdp.fully_shard_optimizer(opt)
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, vocab, (mb, seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1], data[:, 1:]
    times, step_peaks, losses = [], [], []

    def forward_backward_step():
        # No autocast weight cache: a CUDA graph must not keep casts made during capture.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast, cache_enabled=not graphed):
            logits = wrapped(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    def eager_step():
        loss = forward_backward_step()
        opt.zero_grad(set_to_none=True)
        return loss

    train_step = capture_step(forward_backward_step, opt, args.warmup) if graphed else eager_step

    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss = train_step()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) / 1e3
            # Peak of this step alone: separates lazy-init/first-step effects from the steady state.
            step_peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        else:
            dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            losses.append(loss.item())  # after the clock stopped
    if snapshot:
        if dist.get_rank() == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(Path(args.out) / f"memory_{system}_{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)

    # After the measured steps and the memory snapshot, one forward without grad: how many
    # (token, choice) pairs the routing kept (not for a captured CUDA graph, which replays
    # its own forward).
    kept = routing_kept_fraction(inner, lambda: wrapped(tokens), device.type, autocast) \
        if args.experts and not graphed else None
    collectives = None
    if device.type == "cuda" and name in args.timeline.split(","):
        collectives = profile_timeline(train_step, system, name, Path(args.out))
    # Per step the slowest rank decides (element-wise MAX), then the median; the largest rank the memory.
    slowest = torch.tensor(times, device=device, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    first_peak = step_peaks[0] if step_peaks else 0
    steady_peak = max(step_peaks[1:], default=first_peak)
    if graphed:  # the eager warm-up's peak and the captured step's (replays allocate nothing)
        first_peak = max(first_peak, train_step.warmup_peak)
        steady_peak = max(steady_peak, train_step.capture_peak)
    mem_t = torch.tensor([max(first_peak, steady_peak), first_peak, steady_peak, baseline, init_peak, init_s],
                         device=device, dtype=torch.float64)
    dist.all_reduce(mem_t, op=dist.ReduceOp.MAX)
    *mem_t, init_s = mem_t.tolist()
    peak, first_peak, steady_peak, baseline, init_peak = (v / 2**30 for v in mem_t)
    step_s = statistics.median(times)
    tokens_per_gpu = mb * seq / step_s
    result = {
        "system": system, "config": name, "step_s": step_s, "tokens_per_s_per_gpu": tokens_per_gpu,
        "tflops_per_gpu": cfg.flops_per_token(seq) * tokens_per_gpu / 1e12,
        "peak_mem_gib": peak, "first_step_peak_gib": first_peak, "steady_peak_gib": steady_peak,
        "baseline_gib": baseline, "final_loss": loss.item(), "step_times_s": times,
        # Rank 0's loss of each timed step and the optimizer steps taken before the first
        # of them (a graphed system warms up eagerly before capture): trajectories of
        # systems line up once shifted by the difference.
        # Ours: the bucket budgets in effect (bytes) and the link they came from.
        "bucket_budgets": list(model.bucket_budgets()) if hasattr(model, "bucket_budgets") else None,
        "link": dataclasses.asdict(model._fsdp_state.ctx.link) if getattr(getattr(getattr(model, "_fsdp_state", None),
                                                                                   "ctx", None), "link", None) else None,
        "losses": losses, "updates_before_timed_steps": args.warmup + (max(args.warmup, 1) + 1 if graphed else 0),
        "meta_init": args.meta_init, "init_s": init_s, "init_peak_gib": init_peak,
        "experts": args.experts, "top_k": args.top_k if args.experts else None, "ep": args.ep,
        "moe_form": getattr(model, "moe_form", None), "balanced_routing": args.balanced_routing,
        "routing_kept_fraction": kept,
        # Rank 0's NCCL kernels in the profiled step (--timeline): per collective the
        # count, summed kernel time and the largest grid (blocks = SMs it occupies).
        "nccl_kernels": collectives,
        "local_shards_gib": sum(_local(p).numel() * p.element_size() for p in model.parameters()) / 2**30,
    }
    wrapped = model = opt = loss = None  # free before the next system builds
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def capture_step(forward_backward_step, opt, warmup: int):
    """The step captured in one CUDA graph; returns a function that replays it.

    Warm-up runs eagerly on a side stream first (lazy init, the recorded forward order,
    NCCL and cuBLAS setup, the optimizer state), as capture requires. Gradients are
    None before capture, so the captured backward writes them afresh on every replay
    and the captured optimizer step reads them; the inputs are the same tensors each
    step, so replaying trains on the same data as the eager systems."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            forward_backward_step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warmup_peak = torch.cuda.max_memory_allocated()
    # A replay allocates nothing, so the allocator's peak during replays shows only what
    # outlived the capture: the step's own peak is the capture's.
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_loss = forward_backward_step()
    capture_peak = torch.cuda.max_memory_allocated()
    graph.replay()  # the first replay uploads the graph: kept out of every timed step
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        return static_loss

    replay.warmup_peak, replay.capture_peak = warmup_peak, capture_peak
    return replay


def profile_timeline(train_step, system: str, name: str, out: Path):
    """One more step under torch.profiler; rank 0 plots its kernels per stream and returns
    its NCCL kernel summary (None on the other ranks)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_fsdp_ext.trace import kernel_intervals, nccl_kernel_summary, plot_timeline

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trace_{system}_{name}.json"
        prof.export_chrome_trace(str(trace))
        try:
            plot_timeline(kernel_intervals(str(trace)), str(out / f"timeline_{system}_{name}.png"),
                          f"{system} {name}: one step, rank 0 kernels per CUDA stream")
        except ImportError:
            pass
        return nccl_kernel_summary(str(trace))
    return None


def write_outputs(results, out: Path, meta):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["| config | system | step ms | tokens/s/GPU | TFLOP/s/GPU | peak GiB | vs FSDP2 | vs DDP | vs local "
             "| init s | init peak GiB | local shards GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["config"], r["system"]): r for r in results}
    def ratio(r, other):
        return f"{r['step_s'] / other['step_s']:.2f}x" if other else "-"

    for r in results:
        # A compiled system is compared with compiled FSDP2 where that ran.
        peer = "fsdp2_compiled" if r["system"].endswith("_compiled") else "fsdp2"
        f2, dd, lo = by.get((r["config"], peer)), by.get((r["config"], "ddp")), by.get((r["config"], "local"))
        lines.append(
            f"| {r['config']} | {r['system']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{r['tflops_per_gpu']:.1f} | {r['peak_mem_gib']:.2f} | {ratio(r, f2)} | {ratio(r, dd)} | {ratio(r, lo)} | "
            f"{r['init_s']:.1f} | {r['init_peak_gib']:.2f} | {r['local_shards_gib']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    configs = list(dict.fromkeys(r["config"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results))
    fig, ax = plt.subplots(figsize=(2 + 2 * len(configs), 4), dpi=120)
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        ys = [by[(c, s)]["step_s"] * 1e3 if (c, s) in by else 0 for c in configs]
        ax.bar([x + i * width for x in range(len(configs))], ys, width, label=s)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(configs))], configs)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{meta['world']}x {meta['device_name']}, torch {meta['torch']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time.png")
    plt.close(fig)


def main():
    args = parse_args()
    if args.balanced_routing and not args.experts:
        raise SystemExit("--balanced-routing needs --experts")
    device = init_benchmark_process(args.device, standalone_port=29561)
    rank = dist.get_rank()
    meta = dict(run_meta(device), steps=args.steps, warmup=args.warmup,
                timing="per step the slowest rank (all-reduce MAX); step_s = median over steps")
    results = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
        for system in args.systems.split(","):
            if system not in SYSTEMS:
                raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")
            r = run_one(system, name, device, args)
            results.append(r)
            if rank == 0:
                print(f"{name:>14} {system:>14}: {r['step_s'] * 1e3:8.1f} ms/step  "
                      f"{r['tokens_per_s_per_gpu']:>10,.0f} tok/s/GPU  {r['tflops_per_gpu']:6.1f} TFLOP/s  "
                      f"peak {r['peak_mem_gib']:.2f} GiB (first step {r['first_step_peak_gib']:.2f}, "
                      f"steady {r['steady_peak_gib']:.2f}, before build {r['baseline_gib']:.2f})", flush=True)
        if rank == 0:  # after every config: a run cut short still leaves its results
            write_outputs(results, Path(args.out), meta)
    if rank == 0:
        print((Path(args.out) / "results.md").read_text())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
