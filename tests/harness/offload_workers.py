"""Workers for CPU offload (fully_shard(offload_policy=CPUOffloadPolicy())): where the
shards, gradients and gather copies live and when they are reused, and offloaded units
under torch's state-dict helpers, DCP checkpoints, materialize and clip_grad_norm_.
Shared by the Gloo suite (tests/distributed/test_offload.py: the CPU is the device
too) and the GPU suite (tests/gpu/test_offload_gpu.py: host memory beside a GPU)."""
from __future__ import annotations

import gc
import time
from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.dtensor_face import local_numel
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from megatron_fsdp_ext.optim import CPUAdamW
from megatron_fsdp_ext.link import LinkModel
from megatron_fsdp_ext.core.param_index import iter_states

from .workers import device_for_backend, global_batches, shard_blocks_and_root

CFG = LlamaConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, ffn_hidden=64)
PACING_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep on an H100/H200


def offloaded_model(param_dtype=None, pin_memory=True, meta=False):
    torch.manual_seed(7)
    with torch.device("meta" if meta else "cpu"):  # built on the CPU: sharded without moving it whole
        model = LlamaModel(CFG)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    return shard_blocks_and_root(model, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))


def _grad_base(state) -> int:
    """Where the host buffer behind a unit's .grad views starts."""
    ptrs = {p.grad.data_ptr() - 4 * spec.slice.shard_offset
            for p, spec in zip(state.sharded_params, state.unit.param_specs) if p.grad is not None and local_numel(p.grad) > 0}
    assert len(ptrs) == 1, ptrs
    return ptrs.pop()


def _step(model, tokens, targets, rows):
    loss = model.loss(tokens[rows], targets[rows])
    loss.backward()
    return loss


def offload_plumbing(rank: int, world: int, opts: Dict) -> None:
    """Where every buffer of an offloaded unit lives, and its reuse rules."""
    device = device_for_backend()
    param_dtype = opts.get("param_dtype")
    model = offloaded_model(param_dtype)
    states = list(iter_states(model))
    pinned = device.type == "cuda"
    for s in states:
        u = s.unit
        assert u.offloaded and u.pinned == pinned, (s, u.offloaded, u.pinned)
        assert torch.device(u.device).type == device.type, u.device
        assert u.sharded_flat.device.type == "cpu"
        assert all(torch.device(spec.storage_device).type == "cpu" for spec in u.param_specs)
        assert u.sharded_flat.is_pinned() == pinned
        copy_bytes = u.sharded_flat.numel() * 2 if param_dtype == torch.bfloat16 else 0
        assert u.host_nbytes == u.sharded_flat.nbytes + copy_bytes, (u.host_nbytes, u.sharded_flat.nbytes)
        assert (u.host_gather_copy is not None) == (param_dtype == torch.bfloat16)
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = CPUAdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (2 * world, 8), generator=g).to(device)
    targets = torch.randint(0, CFG.vocab_size, (2 * world, 8), generator=g).to(device)
    rows = slice(2 * rank, 2 * rank + 2)

    _step(model, tokens, targets, rows)
    grads = {id(p): p.grad for p in model.parameters() if p.grad is not None}
    assert grads and all(g.device.type == "cpu" and g.is_pinned() == pinned for g in grads.values())
    # One kept host buffer per unit behind its .grad views, counted by host_nbytes. (Only
    # data_ptr() here: a storage object made in Python would itself hold the buffer.)
    first_ptr = {}
    for s in states:
        u = s.unit
        first_ptr[id(s)] = _grad_base(s)
        assert u.host_nbytes == 2 * u.sharded_flat.nbytes + (u.sharded_flat.numel() * 2 if param_dtype else 0)
    del grads  # this test's own references would keep the buffers from reuse
    opt.step()
    if param_dtype == torch.bfloat16:  # CPUAdamW wrote every unit's bf16 gather copy: fresh
        for s in states:
            u = s.unit
            assert u.host_copy_fresh, s
            for spec in u.param_specs:
                sl = spec.slice
                piece = u.sharded_flat.narrow(0, sl.shard_offset, sl.numel)
                assert torch.equal(u.host_gather_copy.narrow(0, sl.shard_offset, sl.numel), piece.to(torch.bfloat16))
    opt.zero_grad(set_to_none=True)
    _step(model, tokens, targets, rows)
    for s in states:  # nothing else held the buffer: reused
        assert _grad_base(s) == first_ptr[id(s)], s
    # A gradient kept by the user across zero_grad(set_to_none=True) is never overwritten.
    kept = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    held = {id(p): p.grad for p in model.parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad(set_to_none=True)
    _step(model, tokens, targets, rows)
    for k, t in held.items():
        assert torch.equal(t, kept[k]), "a held gradient was overwritten by the next backward"
    for s in states:
        assert _grad_base(s) != first_ptr[id(s)], "a held buffer was reused"
    # Another optimizer, an in-place write: the copy is stale and the gather casts the shard.
    if param_dtype == torch.bfloat16:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert not any(s.unit.host_copy_fresh for s in states)
        opt.step()
        assert all(s.unit.host_copy_fresh for s in states)
        with torch.no_grad():
            next(iter(model.parameters())).add_(1.0)
        assert not states[0].unit.host_copy_fresh or states[0].sharded_params[0] is not next(iter(model.parameters()))


def _train(model, opt, steps, world, rank, device, clip=None):
    losses = []
    for tokens, targets in global_batches(CFG, steps, 2 * world, 8, device):
        rows = slice(2 * rank, 2 * rank + 2)
        opt.zero_grad(set_to_none=True)
        losses.append(_step(model, tokens, targets, rows).item())
        if clip:
            mfsdp.clip_grad_norm_(model, clip)
        opt.step()
    return losses


def _values(model):
    return {k: v.detach().cpu() for k, v in mfsdp.full_state_dict(model, rank0_only=False).items()}


def offload_state_dicts(rank: int, world: int, opts: Dict) -> None:
    """Offloaded units under every way state leaves and enters a model."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict)
    from torch.distributed.tensor import DTensor

    device = device_for_backend()
    model = offloaded_model()
    opt = CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, opt, 2, world, rank, device, clip=0.5)
    # torch's helpers: DTensors over host local shards, full values as without offload.
    sd = get_model_state_dict(model)
    assert all(isinstance(v, DTensor) and v.to_local().device.type == "cpu" for v in sd.values())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ours = _values(model)
    assert set(full) == set(ours)
    for k in ours:
        assert torch.equal(full[k].cpu(), ours[k]), k
    osd = get_optimizer_state_dict(model, opt)
    assert osd["state"], "no optimizer state"

    # DCP checkpoint, loaded into an offloaded model and into one on the device.
    path = opts["path"]
    mfsdp.save_checkpoint(path, model, opt)
    for offload in (True, False):
        torch.manual_seed(99)  # different init: the load must overwrite it
        other = LlamaModel(CFG).to(device)
        kw = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        shard_blocks_and_root(other, **kw)
        other_opt = CPUAdamW(other.parameters(), lr=1e-3, weight_decay=0.1) if offload else \
            torch.optim.AdamW(other.parameters(), lr=1e-3, weight_decay=0.1)
        _train(other, other_opt, 1, world, rank, device)  # creates optimizer state to be replaced
        mfsdp.load_checkpoint(path, other, other_opt)
        loaded = _values(other)
        for k in ours:
            assert torch.equal(loaded[k], ours[k]), (offload, k)
        # One more step on both from the same state: same result (optimizer state loaded too).
        b = _train(other, other_opt, 1, world, rank, device)
        if offload:
            a = _train(model, opt, 1, world, rank, device)
            assert abs(a[0] - b[0]) <= 1e-6 * abs(a[0]), (a, b)
            after, theirs = _values(model), _values(other)
            for k in after:
                torch.testing.assert_close(theirs[k], after[k], rtol=1e-5, atol=1e-6)
            mfsdp.save_checkpoint(path, model, opt)  # keep the saved state equal to `model` for the next load
            ours = _values(model)

    # set_model_state_dict from full values into an offloaded model.
    torch.manual_seed(5)
    fresh = shard_blocks_and_root(LlamaModel(CFG), offload_policy=CPUOffloadPolicy())
    set_model_state_dict(fresh, {k: v.to(device) for k, v in ours.items()},
                         options=StateDictOptions(full_state_dict=True))
    for k, v in _values(fresh).items():
        assert torch.equal(v, ours[k]), k

    # Deferred init: built on meta, offloaded, materialized; the same values as eager init.
    meta = offloaded_model(meta=True)
    mfsdp.materialize(meta)
    eager = offloaded_model()
    for s in iter_states(meta):
        assert s.unit.offloaded and s.unit.sharded_flat.device.type == "cpu"
    for k, v in _values(meta).items():
        assert torch.isfinite(v).all(), k
    assert set(_values(meta)) == set(_values(eager))


def offload_config(rank: int, world: int, opts: Dict) -> None:
    """FSDPConfig's Megatron-style fields: optimizer_cpu_offload with a fraction offloads
    the units options.offloaded_units picks, and estimate_memory counts the same host
    bytes the units hold."""
    from megatron_fsdp_ext.models.llama import Block
    from megatron_fsdp_ext.core.options import offloaded_units

    device = device_for_backend()
    fraction = opts["fraction"]
    torch.manual_seed(7)
    with torch.device("meta"):
        shapes = LlamaModel(CFG)
    est = mfsdp.estimate_memory(shapes, world, unit_modules=[Block], offload_fraction=fraction,
                                mp_policy=mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model = LlamaModel(CFG).to(device)
    config = mfsdp.FSDPConfig(bf16=True, grad_reduce_in_fp32=True, optimizer_cpu_offload=True,
                              optimizer_offload_fraction=fraction)
    mfsdp.fully_shard_model(model, config, fsdp_unit_modules=[Block])
    units = [b._mfsdp_state.unit for b in reversed(model.blocks)] + [model._mfsdp_state.unit]
    want = offloaded_units([sum(torch.Size(sp.shape).numel() for sp in u.param_specs) for u in units], fraction)
    assert [u.offloaded for u in units] == want, ([u.offloaded for u in units], want)
    assert any(want) and (fraction == 1.0 or not all(want))
    opt = CPUAdamW([p for u in units if u.offloaded for p in u.sharded_params], lr=1e-3)
    on_device = [p for u in units if not u.offloaded for p in u.sharded_params]
    dev_opt = torch.optim.AdamW(on_device or [torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    for tokens, targets in global_batches(CFG, 2, 2 * world, 8, device):
        model.loss(tokens[2 * rank: 2 * rank + 2], targets[2 * rank: 2 * rank + 2]).backward()
        mfsdp.clip_grad_norm_(model, 0.5)  # host and device gradients in one norm
        opt.step()
        dev_opt.step()
        opt.zero_grad(set_to_none=False)  # kept: the host gradient buffers count below
        dev_opt.zero_grad(set_to_none=False)
    held = sum(u.host_nbytes for u in units)
    # The estimate is the largest over ranks; world 2 splits these units evenly.
    assert held == est.host_pinned, (held, est.host_pinned)


def _gpu_model(device, offload: bool, cfg: LlamaConfig):
    torch.manual_seed(11)
    model = LlamaModel(cfg)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        return shard_blocks_and_root(model, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=True))
    return shard_blocks_and_root(model.to(device), mp_policy=mp)


GPU_CFG = LlamaConfig(vocab_size=1024, d_model=512, n_layers=4, n_heads=8, ffn_hidden=1408)


def offload_streams(rank: int, world: int, opts: Dict) -> Dict:
    """CUDA only. Forward and backward of an offloaded model never make the host wait
    (the one wait is the end of backward's, for the host gradients); the copies in run
    from pinned memory on the all-gather stream and the copies out into pinned memory on
    the reduce-scatter stream, beside the compute stream's kernels."""
    import warnings

    from megatron_fsdp_ext.trace import copy_intervals, kernel_intervals, overlapping

    device = device_for_backend()
    assert device.type == "cuda"
    model = _gpu_model(device, True, GPU_CFG)
    opt = CPUAdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, GPU_CFG.vocab_size, (4, 256), generator=g).to(device)

    def step():
        model.loss(tokens, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    syncs = []
    if dist.get_backend() == "nccl":  # Gloo's own CUDA path waits on the host (its worker threads)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call torch makes raises
        try:
            loss = model.loss(tokens, tokens)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) <= 1, syncs  # at most the end of backward's wait
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        # Paced: this small model's step is CPU-bound (more so at larger worlds), so the
        # compute stream idles between units and nothing could overlap it; a leading sleep
        # puts the GPU behind the CPU, and the trace shows what the stream dependencies allow.
        torch.cuda._sleep(PACING_CYCLES)
        step()
        torch.cuda.synchronize()
    path = f"{opts['dir']}/offload_trace_rank{rank}.json"
    prof.export_chrome_trace(path)
    copies, kernels = copy_intervals(path), kernel_intervals(path)
    h2d = [c for c in copies if "HtoD" in c[0]]
    d2h = [c for c in copies if "DtoH" in c[0]]
    assert h2d and d2h, sorted({c[0] for c in copies})
    assert all("Pinned" in c[0] for c in h2d + d2h), sorted({c[0] for c in h2d + d2h})
    # The compute stream: the one running the most kernels (the side streams run one
    # collective, cast or copy a unit).
    streams = [k[1] for k in kernels]
    compute = max(set(streams), key=streams.count)
    assert not [c for c in h2d + d2h if c[1] == compute], "a copy ran on the compute stream"
    on_compute = [k for k in kernels if k[1] == compute and "spin" not in k[0].lower()]  # not the pacing sleep
    in_overlap = sum(overlapping(c, on_compute) for c in h2d)
    out_overlap = sum(overlapping(c, on_compute) for c in d2h)
    if dist.get_backend() == "nccl":  # Gloo's CUDA collectives wait on the host: nothing overlaps them
        assert in_overlap > 0, (in_overlap, len(h2d))
        # The copies out overlap compute where the reduce-scatter is cheap (world 1). With
        # a real reduce-scatter (2 GPUs) and this small model's short backward, the compute
        # stream finished each unit's backward and waited for the reduction held in flight
        # (copy out included) before the next: none overlapped (measured on 2x H200).
        if world == 1:
            assert out_overlap > 0, (out_overlap, len(d2h))
    return {"h2d": len(h2d), "d2h": len(d2h), "h2d_overlapping": in_overlap, "d2h_overlapping": out_overlap,
            "syncs_in_backward": len(syncs)}


def _warm_up_matmul_workspaces(device) -> None:
    """cuBLAS keeps a workspace per handle (one per thread: forward on this one, backward on
    autograd's device thread) allocated for the process's life: allocated before the
    baseline, they are not taken for memory a model left behind."""
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(a, a, a[0]).sum().backward()
    del a
    torch.cuda.synchronize()


def _collected_allocated() -> int:
    """The device's allocated bytes after a collection (the hooks make reference cycles) and
    once the device is idle."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _quiescent_allocated(timeout_s: float = 5.0) -> int:
    """The device's allocated bytes once they stop changing (three equal readings 50 ms
    apart): what Gloo's thread still held from the last collectives is gone by then."""
    deadline = time.monotonic() + timeout_s
    readings = []
    while True:
        readings = (readings + [_collected_allocated()])[-3:]
        if (len(readings) == 3 and len(set(readings)) == 1) or time.monotonic() > deadline:
            return min(readings)
        time.sleep(0.05)


def _settle_device_memory(baseline: int, timeout_s: float = 10.0, slack: int = 1 << 20) -> None:
    """Wait until the device holds no more than `baseline` bytes again, give or take
    `slack` for process-wide caches (the model's rope tables: 32 KiB here): the hooks make
    reference cycles (a collection frees them), and Gloo keeps a collective's input alive
    until its work object is destroyed on Gloo's own thread, some time after the wait (a
    unit's 14.5 MB shard, measured). Memory still held after `timeout_s` is a leak, and
    fails here by name."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = _collected_allocated()
        if held <= baseline + slack:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{held - baseline} bytes still allocated on the device {timeout_s} s after "
                                 f"the model and its optimizer were deleted (baseline {baseline})")
        time.sleep(0.05)
    torch.cuda.empty_cache()


# An NVLink pair's link as measured (RESULTS.md 21: alpha 45-50 us, 508-545 GB/s).
_FIXED_LINK = LinkModel(alpha_s=50e-6, bytes_per_s=5e11)


def offload_memory(rank: int, world: int, opts: Dict) -> Dict:
    """CUDA only. The device peak of a training step drops by what offloading moves to the
    host (fp32 shard, gradient and AdamW's two states: 16 bytes an element of the shard),
    and the host holds what the units report.

    The peak is bounded on NCCL only. Gloo releases a collective's tensors when its work
    object dies on Gloo's own thread, some time after the wait returned: with several
    ranks sharing a host's cores that held memory lands in either run's peak (measured at
    world 4 on one GPU, four tests at once: the offloaded peak 154 MB in most runs, 195 MB
    in one, and 2 of 12 runs short of the bound by 3-4 MB). The memory between steps, read
    once those tensors are gone, is bounded on both."""
    device = device_for_backend()
    peaks, rest = {}, {}
    _warm_up_matmul_workspaces(device)
    start = torch.cuda.memory_allocated()
    for offload in (False, True):
        model = _gpu_model(device, offload, GPU_CFG)
        # The "auto" buckets come from timing the link, and beside other tests' kernels
        # that timing changes the plan (measured: one reduce bucket holding every unit's
        # gradients in one run, none in the next) and its 96 MiB probe may set the peak.
        # One fixed link gives both runs the same buckets and no probe.
        model.set_link_model(_FIXED_LINK)
        opt = (CPUAdamW if offload else torch.optim.AdamW)(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, GPU_CFG.vocab_size, (2, 128), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            model.loss(tokens, tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated()
        rest[offload] = _quiescent_allocated()  # between steps: shards and AdamW state
        shard_elems = sum(s.unit.sharded_flat.numel() for s in iter_states(model))
        largest_unit = max(s.unit.sharded_flat.numel() for s in iter_states(model))
        del model, opt, tokens
        _settle_device_memory(start)  # the first model must be gone before the second is measured
    # Between steps the device holds no shard and no optimizer state (12 bytes an element
    # without offload). At the peak those 12 bytes are off the device too, less what an
    # offloaded step stages on the device: the units in flight (the one computing and the
    # one prefetched) hold their fp32 shard copied in and their reduced fp32 gradient on
    # its way out (8 bytes an element of a unit's shard). Where each run peaks differs, so
    # the gradients' 4 bytes are not counted (measured on NCCL: 9.2 bytes an element saved
    # at world 4, 11.5 at world 2).
    assert rest[True] <= rest[False] - 0.95 * 12 * shard_elems, (rest, shard_elems)
    peak_bounded = dist.get_backend() == "nccl"
    if peak_bounded:
        staged = 2 * 8 * largest_unit
        assert peaks[False] - peaks[True] >= 12 * shard_elems - staged, (peaks, shard_elems, largest_unit)
    return {"peak_device": peaks[False], "peak_offload": peaks[True], "rest": rest, "elements": shard_elems,
            "largest_unit": largest_unit, "peak_bounded": peak_bounded}


def cpu_optimizer_refuses_device_params(rank: int, world: int, opts: Dict) -> None:
    device = device_for_backend()
    p = torch.nn.Parameter(torch.randn(8, device=device))
    p.grad = torch.randn(8, device=device)
    try:
        CPUAdamW([p]).step()
    except RuntimeError as e:
        assert "steps host tensors" in str(e) and "offload_policy=CPUOffloadPolicy()" in str(e), e
    else:
        raise AssertionError("CPUAdamW stepped a device parameter")


def overlapped_step_contract(rank: int, world: int, opts: Dict) -> None:
    """CPUAdamW(overlap_step=True): step() returns before the units' updates are done; the
    values after synchronize() (or any library read) are the synchronous step's; a failing
    update surfaces at the unit's next gather, naming it."""
    device = device_for_backend()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (2 * world, 8), generator=g).to(device)
    rows = slice(2 * rank, 2 * rank + 2)
    results, losses = {}, {}
    # (overlapped, zeroed in place by nn.Module.zero_grad while the update may still read them)
    runs = ((False, False), (True, False), (True, True))
    for run in runs:
        overlap, module_zero = run
        model = offloaded_model()
        opt = CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, overlap_step=overlap)
        # Every update starts 30 ms late: a gather that did not wait would see the old shard.
        _C.set_host_task_delay_ms(30 if overlap else 0)
        try:
            losses[run] = []
            for _ in range(3):
                losses[run].append(_step(model, tokens, tokens, rows).item())
                opt.step()
                if module_zero:  # writes the gradients the update reads: must wait for it
                    model.zero_grad(set_to_none=False)
                else:
                    opt.zero_grad(set_to_none=True)  # drops references only: does not wait
        finally:
            _C.set_host_task_delay_ms(0)
        if overlap:
            assert opt._pending, "no update was handed to the background thread"
            opt.synchronize()
            assert not opt._pending and not any(s.unit.host_update_pending for s in iter_states(model))
        results[run] = [p.detach().clone() for p in model.parameters()]
    for run in runs[1:]:
        assert losses[runs[0]] == losses[run], losses
        for a, b in zip(results[runs[0]], results[run]):
            assert torch.equal(a, b), f"the overlapped step {run} differs from the synchronous one"
    # A failing update: exp_avg of the wrong size (a corrupted state), raised at the next gather.
    model = offloaded_model()
    opt = CPUAdamW(model.parameters(), lr=1e-3, overlap_step=True)
    _step(model, tokens, tokens, rows)
    opt.step()
    opt.synchronize()
    block_param = next(p for p in model.blocks[1].parameters() if p.numel() > 1)
    opt.state[block_param]["exp_avg"] = torch.zeros(block_param.numel() + 1)
    opt.zero_grad(set_to_none=True)
    _step(model, tokens, tokens, rows)
    opt.step()  # returns; the failure is in flight
    try:
        _step(model, tokens, tokens, rows)
    except RuntimeError as e:
        assert "CPUAdamW.step() of unit 'blocks.1" in str(e) and "exp_avg" in str(e), e
    else:
        raise AssertionError("the failed update went unnoticed")
