"""Test workers that need CUDA GPUs and NCCL (tests/gpu): stream races, device errors,
peak memory measured by the CUDA caching allocator, compute/communication overlap read
from torch.profiler traces, and a training step captured in a CUDA graph.

The memory, overlap and CUDA-graph checks compare the engine against quantities it does
not report itself: the allocator's counters, bytes computed from parameter shapes,
kernel timestamps, and a plain single-process PyTorch model trained on the same data.
"""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.core.states import BackwardProgress

from .workers import (build_models, device_for_backend, expect_error, global_batches, make_optimizer, rel_err, shard,
                      shard_blocks_and_root, train_parity, unique_storage_bytes)


def _sleep_cycles() -> int:
    return 20_000_000  # ~10 ms on an H200: long enough to expose a missing wait


@contextlib.contextmanager
def stream_chaos():
    """Fault injection, not observation: while active, delay the compute stream right
    before every unshard and gradient reduction, the side streams right before their
    collectives are issued, and (CommContext.fault_delay_cycles) the side streams right
    after each collective, before its results land and its done event is recorded. So any
    missing cross-stream wait produces wrong numbers instead of passing by luck, also
    where the host itself waits for the collective (Gloo): there only what follows the
    collective on the side stream can race. Everything is restored on exit."""
    from megatron_fsdp_ext.core import hook_support, hooks

    def as_cuda_stream(s):
        return torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    orig_units_to_gather = hook_support.units_to_gather
    orig_unshard = hooks.FSDPState.unshard
    orig_post_backward = hooks.FSDPState.post_backward
    contexts = []

    def delay_before_gathers(states):
        ctx = next((s.ctx for s in states if s.unit is not None and s.ctx is not None), None)
        if ctx is None:
            return
        if ctx.comm.fault_delay_cycles == 0:
            ctx.comm.fault_delay_cycles = _sleep_cycles()
            contexts.append(ctx.comm)
        torch.cuda._sleep(_sleep_cycles())            # compute still busy when AG starts
        with torch.cuda.stream(as_cuda_stream(ctx.comm.all_gather_stream())):
            torch.cuda._sleep(_sleep_cycles())        # AG late: compute must wait for it

    def units_to_gather(states):  # forward and backward gathers (with prefetch), just before they are issued
        delay_before_gathers(states)
        return orig_units_to_gather(states)

    def unshard(self):  # activation-checkpoint recompute, start_param_sync
        delay_before_gathers([self])
        orig_unshard(self)

    def post_backward(self, *args, **kwargs):
        if self.unit is not None and self.backward_progress is not BackwardProgress.REDUCED:
            torch.cuda._sleep(_sleep_cycles())            # grads packed late on compute
            with torch.cuda.stream(as_cuda_stream(self.ctx.comm.reduce_scatter_stream())):
                torch.cuda._sleep(_sleep_cycles())        # RS late: optimizer must wait
        orig_post_backward(self, *args, **kwargs)

    hook_support.units_to_gather = units_to_gather
    hooks.FSDPState.unshard = unshard
    hooks.FSDPState.post_backward = post_backward
    try:
        yield
    finally:
        hook_support.units_to_gather = orig_units_to_gather
        hooks.FSDPState.unshard = orig_unshard
        hooks.FSDPState.post_backward = orig_post_backward
        for comm in contexts:
            comm.fault_delay_cycles = 0


def train_parity_with_stream_chaos(rank: int, world: int, opts: Dict) -> Dict:
    with stream_chaos():
        return train_parity(rank, world, opts)


def cuda_device_errors(rank: int, world: int) -> None:
    """Parameters on a device the process group's backend does not communicate, on
    another GPU than the current one, or on mixed devices are refused with a clear
    message; CUDA parameters on a Gloo group are accepted (Gloo carries CUDA tensors)."""
    if dist.get_backend() == "nccl":
        m = nn.Linear(4, 4)  # CPU params, default NCCL group
        expect_error(lambda: mfsdp.fully_shard(m), ValueError, "backend 'nccl' communicates cuda tensors",
                     "move the module to cuda")
    gloo = dist.new_group(backend="gloo")
    m = mfsdp.fully_shard(nn.Linear(4, 4).cuda(), process_group=gloo)
    assert m.weight.device.type == "cuda"
    if torch.cuda.device_count() > 1:
        other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
        m = nn.Linear(4, 4).to(f"cuda:{other}")
        expect_error(lambda: mfsdp.fully_shard(m), ValueError, "current CUDA device")
    m = nn.Sequential(nn.Linear(4, 4).cuda(), nn.Linear(4, 4))
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "different devices")


def unsharded_memory_released(rank: int, world: int) -> Dict:
    """After a training step every unit is resharded, no side buffer is in flight,
    zero_grad(set_to_none=True) frees all gradient memory (the units keep no
    reference), and allocated memory does not grow from step to step."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 4, "d_model": 256, "ffn": 688, "vocab": 512}, device)
    shard(model, {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    after, drops = [], []
    for tokens, targets in global_batches(cfg, 4, 4, 64, device):
        model.loss(tokens, targets).backward()
        opt.step()
        torch.cuda.synchronize()
        grad_bytes = unique_storage_bytes(p.grad for p in model.parameters())
        before = torch.cuda.memory_allocated()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        drops.append((before - after[-1], grad_bytes))
        for m in model.modules():
            st = m.__dict__.get("_mfsdp_state")
            if st is not None and st.unit is not None:
                assert st.unit.unsharded_storage_bytes == 0, f"{st} still holds unsharded storage"
                assert st.ctx.comm.num_inflight_reductions == 0
    for freed, grad_bytes in drops:
        assert freed >= grad_bytes, f"zero_grad freed {freed} bytes of {grad_bytes} gradient bytes: something keeps grads alive"
    # No growth once the optimizer state exists (from the second step on).
    assert max(after[1:]) <= after[1] + (256 << 10), f"allocated memory grows: {after}"
    return {"allocated_after_step": after, "freed_by_zero_grad": drops}


# ---------------------------------------------------------------- peak memory, read from the allocator

# What a measured peak may exceed its itemised bound by: gradients of activations in
# backward, RoPE tables, the loss, the bf16 copies of the inputs, alignment padding
# (at most 16 elements per parameter) and the collectives' small tensors.
MEMORY_MARGIN = 8 << 20


def _requested_bytes(which: str = "current") -> int:
    """Bytes the program has asked the CUDA caching allocator for ("current" or "peak",
    the latter since the last reset_peak_memory_stats). Unlike allocated bytes they are
    not rounded up to the allocator's blocks (a reused block may be up to 1 MiB larger
    than the request), so they can be compared with bytes computed from shapes."""
    return torch.cuda.memory_stats()[f"requested_bytes.all.{which}"]


def _llama_on_device(cfg: LlamaConfig, device) -> LlamaModel:
    """A seeded fp32 LlamaModel initialised directly on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaModel(cfg)


def _shard_bf16(model: LlamaModel, depth: int) -> LlamaModel:
    """Every block and the root sharded with bf16 parameters and fp32 gradient reduction,
    one collective per unit (what these tests bound and count: buckets, the "auto"
    default, gather several units at once)."""
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_blocks_and_root(model, mp_policy=mp, prefetch_depth=depth)
    model.set_gather_bucket_bytes(0)
    model.set_reduce_bucket_bytes(0)
    return model


def _plain_forward_bytes(cfg: LlamaConfig, tokens, targets, device) -> int:
    """Peak bytes a plain bf16 LlamaModel (no FSDP) adds to its parameters during
    forward: saved activations, logits, loss and forward temporaries."""
    plain = _llama_on_device(cfg, device).to(torch.bfloat16)
    torch.cuda.synchronize()
    before = _requested_bytes()
    torch.cuda.reset_peak_memory_stats()
    loss = plain.loss(tokens, targets)
    peak = _requested_bytes("peak") - before
    del loss, plain
    return peak


def _create_cublas_workspaces(device) -> None:
    """cuBLAS keeps a workspace per (handle, stream) in the caching allocator (32 MiB on
    Hopper), allocated at a thread's first matmul; the autograd thread has a handle of its
    own. One plain forward and backward creates both before anything is measured, so
    neither is counted as activations or as memory held between steps."""
    w = torch.randn(64, 64, device=device, requires_grad=True)
    (torch.randn(8, 64, device=device) @ w).sum().backward()
    torch.cuda.synchronize()


def _live_blocks() -> Dict[int, dict]:
    """The caching allocator's allocated blocks by address (with their Python allocation
    stacks while _record_memory_history records them)."""
    return {b["address"]: b for seg in torch.cuda.memory_snapshot() for b in seg.get("blocks", [])
            if b.get("state") == "active_allocated"}


def _blocks_since(before: Dict[int, dict], top: int = 12) -> str:
    """Diagnostics for a failed bound: the blocks allocated since `before` and still live,
    grouped by the innermost library/harness frames that allocated them (count and bytes
    per call site, the largest sites first)."""
    try:
        new = [b for a, b in _live_blocks().items() if a not in before]
        sites: Dict[str, list] = {}
        for b in new:
            frames = [f for f in b.get("frames", []) if "megatron_fsdp_ext" in f.get("filename", "")
                      or "harness" in f.get("filename", "") or "torch/optim" in f.get("filename", "")] \
                or b.get("frames", [])
            where = " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:3])
            site = sites.setdefault(where or "(no stack)", [0, 0, set()])
            size = b.get("requested_size", b["size"])
            site[0] += 1
            site[1] += size
            site[2].add(size)
        ranked = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
        lines = [f"{n} x ({', '.join(map(str, sorted(sizes, reverse=True)[:3]))} B) = {total} B at {where}"
                 for where, (n, total, sizes) in ranked]
        total = sum(b.get("requested_size", b["size"]) for b in new)
        return f"{len(new)} blocks ({total} B) allocated since the baseline and live now, by site: " + "; ".join(lines)
    except Exception as e:  # diagnostics only: never hide the assertion itself
        return f"(no block listing: {e!r})"


@contextlib.contextmanager
def _allocation_stacks():
    """Record the Python stack of every live allocation (no event history) while active,
    so a failed memory bound names who holds the surplus. Diagnostics only."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    try:
        if record is not None:
            record(enabled="state", stacks="python")
    except Exception:
        record = None
    try:
        yield
    finally:
        if record is not None:
            record(enabled=None)


def _step_memory(cfg: LlamaConfig, depth: int, tokens, targets, world: int, activations: int) -> Dict:
    """Steady-state bytes and forward/backward peaks of one ZeRO-3 bf16 training step,
    each checked against a bound computed from the model's parameter shapes."""
    gc.collect()
    torch.cuda.synchronize()
    baseline = _requested_bytes()
    baseline_blocks = _live_blocks()
    model = _llama_on_device(cfg, tokens.device)
    # From the parameter shapes, before sharding: the root unit owns what no block owns.
    root_numel = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    _shard_bf16(model, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The first step records the order and creates the sharded gradients and Adam's state;
    # zero_grad(set_to_none=False) keeps the gradients, so the steady state holds them.
    for _ in range(2):
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    steady = _requested_bytes()

    bf16 = torch.bfloat16.itemsize
    # Between steps: this rank's 1/world of every parameter as an fp32 shard, its fp32
    # gradient and Adam's two fp32 moments.
    persistent = 16 * sum(-(-n // world) for n in [root_numel] + [block_numel] * cfg.n_layers)
    # Named in the message below when the steady state holds more or less than that.
    steady_blocks = _blocks_since(baseline_blocks) if abs(steady - baseline - persistent) > MEMORY_MARGIN else ""
    root_bytes, block_bytes = bf16 * root_numel, bf16 * block_numel
    largest = max(root_numel, block_numel)
    # Forward: the root and at most 1 + depth blocks unsharded (the block running and
    # the ones prefetched), plus activations.
    forward_bound = root_bytes + (1 + depth) * block_bytes + activations + MEMORY_MARGIN
    # Backward: the root's parameters and bf16 gradients (reduced last), at most 2 + depth
    # blocks unsharded, and for the largest unit its bf16 gradients, its flat fp32 reduce
    # buffer and fp32 reduce-scatter output (one reduction in flight: the previous one is
    # retired before the next buffer is allocated).
    backward_bound = (2 * root_bytes + (2 + depth) * block_bytes + (bf16 + 4) * largest + 4 * largest // world
                      + activations + MEMORY_MARGIN)

    torch.cuda.reset_peak_memory_stats()
    loss = model.loss(tokens, targets)
    forward_peak = _requested_bytes("peak") - steady
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    backward_peak = _requested_bytes("peak") - steady
    torch.cuda.synchronize()
    del loss, opt, model
    gc.collect()

    held = steady - baseline
    where = f"{cfg.n_layers} blocks, prefetch depth {depth}"
    mib = 2 ** 20
    assert abs(held - persistent) <= MEMORY_MARGIN, (
        f"{where}: {held / mib:.1f} MiB held between steps, expected {persistent / mib:.1f} MiB "
        f"(fp32 shard + gradient + 2 Adam moments per parameter, 1/world each); {steady_blocks}")
    assert forward_peak <= forward_bound, (
        f"{where}: forward peak {forward_peak / mib:.1f} MiB above the steady state > bound "
        f"{forward_bound / mib:.1f} MiB (root {root_bytes / mib:.1f} + {1 + depth} x block {block_bytes / mib:.1f} "
        f"+ activations {activations / mib:.1f} MiB)")
    assert backward_peak <= backward_bound, (
        f"{where}: backward peak {backward_peak / mib:.1f} MiB above the steady state > bound "
        f"{backward_bound / mib:.1f} MiB")
    return {"held_between_steps": held, "persistent": persistent, "forward_peak": forward_peak,
            "forward_bound": forward_bound, "backward_peak": backward_peak, "backward_bound": backward_bound,
            "activations": activations, "block_unsharded_bytes": block_bytes}


def allocator_memory_bound(rank: int, world: int, block_counts=(4, 8), depths=(0, 1, 2)) -> Dict:
    """Peak memory of a ZeRO-3 bf16 step read from the CUDA caching allocator (requested
    bytes, peaks reset before forward and before backward), never from the engine's own
    counters. For each prefetch depth and number of blocks: the bytes held between steps
    equal the shard/gradient/Adam bytes computed from the parameter shapes, the forward and
    backward peaks stay under bounds made of whole units' bf16 bytes (from the shapes)
    plus the activations a plain PyTorch copy of the model holds, and going from the
    fewest to the most blocks grows the peaks by no more than those activations grow."""
    device = device_for_backend()
    # Wide blocks and 16 tokens: a unit's parameters dwarf the activations, so one unit
    # too many shows far above the noise.
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 4096, (2, 9), generator=g)
    tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    _create_cublas_workspaces(device)
    results = {}
    with _allocation_stacks():
        for n_blocks in block_counts:
            cfg = LlamaConfig(vocab_size=4096, d_model=2048, n_layers=n_blocks, n_heads=16, ffn_hidden=5504)
            activations = _plain_forward_bytes(cfg, tokens, targets, device)
            for depth in depths:
                results[(n_blocks, depth)] = _step_memory(cfg, depth, tokens, targets, world, activations)
    fewest, most = min(block_counts), max(block_counts)
    mib = 2 ** 20
    for depth in depths:
        small, large = results[(fewest, depth)], results[(most, depth)]
        allowed = large["activations"] - small["activations"] + MEMORY_MARGIN
        assert allowed < small["block_unsharded_bytes"] / 2, (
            f"activations grow by {allowed / mib:.1f} MiB from {fewest} to {most} blocks: the comparison "
            f"could not tell one more unsharded block ({small['block_unsharded_bytes'] / mib:.1f} MiB)")
        for phase in ("forward_peak", "backward_peak"):
            grew = large[phase] - small[phase]
            assert grew <= allowed, (
                f"prefetch depth {depth}: the {phase.replace('_', ' ')} grew by {grew / mib:.1f} MiB from {fewest} "
                f"to {most} blocks, activations only by {allowed / mib:.1f} MiB (with margin): memory held for "
                "parameters grows with the number of blocks")
    return {f"{n}_blocks_depth_{d}": r for (n, d), r in results.items()}


# ---------------------------------------------------------------- overlap, read from profiler traces

# Wide enough that a block's compute lasts several times its all-gather on an H100/H200,
# as in real training: an engine that overlaps at all overlaps nearly every collective.
OVERLAP_BLOCKS = 8
PACING_CYCLES = 20 * 20_000_000  # ~200 ms of sleep kernel: longer than the CPU takes to launch a step


def _marker() -> None:
    """A ~1 us kernel on the compute stream that tags a phase boundary in the trace."""
    torch.cuda._sleep(1000)


def _profiled_kernels(fn: Callable[[], None], path: Optional[str] = None):
    """Run fn under torch.profiler (CUDA activity) and return its kernels. The chrome
    trace is kept at `path`; without one it goes to a temporary directory, removed once
    read."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_fsdp_ext.trace import kernel_intervals

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if path is not None:
        prof.export_chrome_trace(path)
        return kernel_intervals(path)
    with tempfile.TemporaryDirectory(prefix="mfsdp_trace_") as scratch:
        scratch_path = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(scratch_path)
        return kernel_intervals(scratch_path)


def overlap_profile(rank: int, world: int, n_blocks: int = OVERLAP_BLOCKS, trace_dir: str = "") -> Dict:
    """Overlap of collectives with compute, per kernel, from torch.profiler traces of a
    Llama stack (d_model 2048, 8 x 2048 tokens, bf16). A collective counts as overlapped
    when compute-stream kernels run during at least half of it (step_overlap). Three runs:

    normal:     a step right after another, nothing waiting for the GPU in between, as in
                training: of N blocks, at least N-2 forward all-gathers, N-2 backward
                all-gathers and N-2 reduce-scatters overlap compute, and N-3 backward
                all-gathers run beside a reduce-scatter (their own communicator);
    paced:      a leading sleep puts the GPU far behind the CPU, so the trace shows what
                the stream dependencies allow: at least N-1 forward all-gathers overlap;
    serialized: the negative control, prefetch off and every reduction waited for at
                once: at most one collective of each kind overlaps, so the measurement
                tells overlap from serial execution.
    Every run must also show one all-gather per unit in forward (root + N), one per block
    in backward and one reduce-scatter per unit."""
    from megatron_fsdp_ext.core.param_index import iter_states

    from megatron_fsdp_ext.trace import plot_timeline, step_overlap

    device = device_for_backend()
    cfg = LlamaConfig(vocab_size=8192, d_model=2048, n_layers=n_blocks, n_heads=16, ffn_hidden=5504)
    model = _shard_bf16(_llama_on_device(cfg, device), depth=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = list(global_batches(cfg, 4, 8, 2048, device))

    def step(i: int, marked: bool = False, begin_marker: bool = True) -> None:
        tokens, targets = batches[i]
        if marked and begin_marker:
            _marker()
        loss = model.loss(tokens, targets)
        if marked:
            _marker()
        loss.backward()
        if marked:
            _marker()
        opt.step()
        opt.zero_grad()

    def normal() -> None:
        step(2)
        step(3, marked=True)

    def paced() -> None:
        torch.cuda._sleep(PACING_CYCLES)  # doubles as the begin marker
        step(2, marked=True, begin_marker=False)

    for i in range(2):  # lazy init, recorded order, NCCL communicators, Adam state
        step(i)
    # Rank 0's traces are kept (they go into the device run's log tarball); the others' are not.
    def kept(name: str) -> Optional[str]:
        return os.path.join(trace_dir, f"overlap_{name}_rank{rank}.json") if trace_dir and rank == 0 else None

    traces = {}
    traces["normal"] = _profiled_kernels(normal, kept("normal"))
    traces["paced"] = _profiled_kernels(paced, kept("paced"))
    model.set_prefetch_depth(0)
    for state in iter_states(model):
        state.set_options(overlap_grad_reduce=False)
    traces["serialized"] = _profiled_kernels(paced, kept("serialized"))
    if trace_dir and rank == 0:
        try:
            for name in ("normal", "paced"):
                plot_timeline(traces[name], os.path.join(trace_dir, f"overlap_timeline_{name}.png"),
                              f"fully_shard, {n_blocks} blocks: {name} step, rank 0")
        except ImportError:  # matplotlib is optional
            pass
    stats = {name: step_overlap(kernels) for name, kernels in traces.items()}

    n = n_blocks
    # One all-reduce of the gradient flags before each reduce-scatter (Unit::agree_on_grads).
    counts = {"fwd_all_gathers": n + 1, "bwd_all_gathers": n, "reduce_scatters": n + 1, "bwd_all_reduces": n + 1,
              "unclassified_collectives": 0}
    for name, s in stats.items():
        for key, expected in counts.items():
            assert s[key] == expected, f"{name} step: {key} = {s[key]}, expected {expected} (root + {n} blocks): {s}"
    normal_stats = stats["normal"]
    fwd_ag_ms = sorted(normal_stats["fwd_all_gather_ms"])[n // 2]
    assert normal_stats["fwd_compute_ms"] / n >= 2 * fwd_ag_ms, (
        f"a block computes for {normal_stats['fwd_compute_ms'] / n:.2f} ms, less than twice its all-gather "
        f"({fwd_ag_ms:.2f} ms): the model is too small for this GPU to show overlap")
    # Backward gathers beside a reduce-scatter are reported, not bounded: each
    # reduce-scatter now follows its unit's gradient-flag all-reduce on the same stream
    # (Unit::agree_on_grads), and how many gathers meet one varies from run to run (1 and
    # 4 of 8 on 2x H200; 5 before the all-reduce). The step did not get slower
    # (benchmarks/RESULTS.md, table 23).
    minimums = {
        "normal": {"fwd_all_gathers_overlapped": n - 2, "bwd_all_gathers_overlapped": n - 2,
                   "reduce_scatters_overlapped": n - 2},
        "paced": {"fwd_all_gathers_overlapped": n - 1, "bwd_all_gathers_overlapped": n - 2,
                  "reduce_scatters_overlapped": n - 2},
    }
    for name, wanted in minimums.items():
        for key, least in wanted.items():
            assert stats[name][key] >= least, (
                f"{name} step: {key} = {stats[name][key]} < {least} ({n} blocks): {stats[name]}")
    for key in ("fwd_all_gathers_overlapped", "bwd_all_gathers_overlapped", "reduce_scatters_overlapped",
                "bwd_all_gathers_beside_reduce_scatters"):
        assert stats["serialized"][key] <= 1, (
            f"negative control (no prefetch, every reduction waited for): {key} = {stats['serialized'][key]}; "
            f"the measurement does not tell overlap from serial execution: {stats['serialized']}")
    return stats


# ---------------------------------------------------------------- CUDA graphs

def cuda_graph_training(rank: int, world: int, warmup: int = 3, replays: int = 3, buckets: Optional[Dict] = None) -> Dict:
    """With all_gather_in_start_param_sync off (the default) nothing is launched outside
    forward/backward, so a whole training step (forward, backward with its
    reduce-scatters, a capturable AdamW step) is captured once in a CUDA graph and
    replayed on new data. Reference: a plain single-process copy of the model (no FSDP,
    no graph) trained eagerly with AdamW on the whole global batch. Every replayed loss
    and the final parameters match it within the NCCL parity suite's fp32 tolerance.
    `buckets`: gather_bucket_bytes / reduce_bucket_bytes (the coalesced collectives and
    the held gradients are captured too)."""
    device = device_for_backend()
    cfg, graphed, reference = build_models({}, device)  # the parity suite's fp32 model
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    shard(graphed, buckets or {})
    # lr 1e-4 as in the parity suite: Adam turns rounding differences of near-zero
    # gradients (the reduction order differs from the reference's) into steps of up to lr.
    opt = torch.optim.AdamW(graphed.parameters(), lr=1e-4, weight_decay=0.1, capturable=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, weight_decay=0.1)
    per = 4
    rows = slice(rank * per, (rank + 1) * per)
    batches = list(global_batches(cfg, warmup + replays, per * world, 16, device))

    def reference_step(tokens, targets) -> float:
        ref_opt.zero_grad(set_to_none=True)
        loss = reference.loss(tokens, targets)
        loss.backward()
        ref_opt.step()
        return loss.item()

    def graphed_step(tokens, targets):
        loss = graphed.loss(tokens, targets)
        loss.backward()
        opt.step()
        return loss

    # Warm-up on a side stream (lazy init, recorded forward order, NCCL and cuBLAS
    # setup, Adam state), as CUDA graph capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for tokens, targets in batches[:warmup]:
            opt.zero_grad(set_to_none=True)
            graphed_step(tokens[rows], targets[rows])
    torch.cuda.current_stream().wait_stream(side)
    for tokens, targets in batches[:warmup]:
        reference_step(tokens, targets)
    torch.cuda.synchronize()

    static_tokens, static_targets = batches[warmup][0][rows].clone(), batches[warmup][1][rows].clone()
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_loss = graphed_step(static_tokens, static_targets)
    loss_errs = []
    for tokens, targets in batches[warmup:]:
        static_tokens.copy_(tokens[rows])
        static_targets.copy_(targets[rows])
        graph.replay()
        # Every rank has as many rows: the mean of the ranks' losses is the global batch's.
        mean = static_loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = reference_step(tokens, targets)
        loss_errs.append(abs(mean.item() / world - ref_loss) / abs(ref_loss))
    full = mfsdp.full_state_dict(graphed, rank0_only=False)
    ref_sd = reference.state_dict()
    errs = {k: rel_err(full[k], ref_sd[k]) for k in ref_sd}
    moved = {k: rel_err(ref_sd[k], initial[k]) for k in ref_sd}
    worst = max(errs, key=errs.get)
    # fp32 throughout: the parity suite's 1e-5 (same model, lr and step count within one).
    tol = 1e-5
    assert max(loss_errs) <= tol, f"replayed losses differ from the reference: rel err {loss_errs}"
    assert errs[worst] <= tol, f"parameter '{worst}' rel err {errs[worst]:.2e} > {tol} after {replays} replays"
    # Every weight matrix moved far more than the tolerance: a replay that skipped the
    # optimizer step (or training that never moved) fails the comparison above.
    still = {k: v for k, v in moved.items() if ref_sd[k].dim() >= 2 and v <= 100 * tol}
    assert not still, f"weights barely moved, the comparison proves nothing: {still}"
    return {"loss_rel_errs": loss_errs, "worst_param": worst, "worst_param_rel_err": errs[worst]}


def forward_event_calls(rank: int, world: int, buckets: Dict) -> Dict:
    """CUDA event records and stream waits the forward issues (CUDA runtime calls under
    the profiler, one forward after the order was recorded), and the number of units.
    A gather bucket records one done event for all its units, and the compute stream
    waits for it once."""
    from torch.profiler import ProfilerActivity, profile

    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 6}, device)
    shard(model, buckets)
    tokens, targets = next(iter(global_batches(cfg, 1, 2 * world, 8, device)))
    rows = slice(2 * rank, 2 * rank + 2)
    for _ in range(2):
        model.loss(tokens[rows], targets[rows]).backward()
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.loss(tokens[rows], targets[rows])
        torch.cuda.synchronize()
    calls = {"cudaEventRecord": 0, "cudaStreamWaitEvent": 0}
    for e in prof.events():
        if e.name in calls:
            calls[e.name] += 1
    calls["units"] = sum(1 for m in model.modules() if "_mfsdp_state" in m.__dict__)
    return calls


def host_synchronizations_in_a_step(rank: int, world: int, opts: Dict) -> int:
    """A steady-state training step (forward, backward, clip_grad_norm_, fused AdamW,
    zero_grad) under torch's CUDA sync debug mode set to raise: any host-synchronizing
    CUDA call in the library's hooks, collectives or clipping fails the step. A step that
    waits for the GPU cannot run ahead of it, which is what keeps many small units from
    being CPU-bound. Returns the number of steps checked."""
    device = device_for_backend()
    cfg, model, _ = build_models({"layers": 4}, device)
    shard(model, opts)
    opt = make_optimizer(model.parameters(), {"fused": True})
    batches = list(global_batches(cfg, 4, 2 * world, 8, device))  # on the GPU before the checked steps
    rows = slice(2 * rank, 2 * rank + 2)

    def step(tokens, targets):
        model.loss(tokens[rows], targets[rows]).backward()
        mfsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for tokens, targets in batches[:2]:  # the recording step, then the first bucketed one
        step(tokens, targets)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tokens, targets in batches[2:]:
            step(tokens, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return len(batches) - 2
