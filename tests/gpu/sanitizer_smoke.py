"""The CUDA code paths of the extension in one process (NCCL, world 1), made to run
under `compute-sanitizer --tool memcheck` (tests/gpu/sanitizer_run.sh): the packing and
cast kernels, units under every strategy and mixed precision against plain PyTorch,
uneven collectives, and freed unsharded memory refusing reads. Exits non-zero on any
failed check; prints one line per part."""
from __future__ import annotations

import copy
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C

STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24)) for _ in range(3)])
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def kernels(dev) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        sizes = [1, 7, 33, 0, 130, 5]
        tensors = [torch.randn(n, generator=g).to(dev, dtype) for n in sizes]
        offsets, cursor = [], 3
        for n in sizes:
            offsets.append(cursor)
            cursor += n + 5
        for flat_dtype in (torch.float32, dtype):
            flat = torch.full((cursor + 2,), 7.0, device=dev, dtype=flat_dtype)
            _C.pack_into_flat(flat, tensors, offsets, False, True)
            expect = torch.zeros_like(flat)  # zero_fill_first: the gaps are zeroed
            for t, o in zip(tensors, offsets):
                expect[o: o + t.numel()] = t.to(flat_dtype)
            check(torch.equal(flat, expect), f"pack_into_flat {dtype}->{flat_dtype}")
            _C.pack_into_flat(flat, tensors, offsets, True, False)
            check(torch.allclose(flat.float(), 2 * expect.float(), rtol=1e-2, atol=1e-2),
                  f"pack_into_flat accumulate {dtype}->{flat_dtype}")
        src = torch.randn(1001, generator=g).to(dev, dtype)
        dst = torch.randn(1001, generator=g).to(dev)
        before = dst.clone()
        _C.cast_scale_into(dst, src, 0.25, True)
        check(torch.allclose(dst, before + 0.25 * src.float(), atol=1e-6), f"cast_scale_into accumulate {dtype}")
        _C.cast_scale_into(dst, src, 0.5, False)
        check(torch.allclose(dst, 0.5 * src.float(), atol=1e-6), f"cast_scale_into {dtype}")
    print("kernels ok", flush=True)


def uneven_collectives(dev) -> None:
    comm = _C.Communicator(dist.distributed_c10d._get_default_group())
    algos = (_C.VarAlgo.AUTO, _C.VarAlgo.GROUPED, _C.VarAlgo.PADDED) if dev.type == "cuda" else (_C.VarAlgo.PADDED,)
    for algo in algos:
        out = torch.zeros(40, device=dev)
        mine = torch.arange(13, dtype=torch.float32, device=dev)
        comm.all_gather_v(out, mine, [5], [13], algo)
        check(torch.equal(out[5:18], mine) and out[:5].abs().sum() == 0, f"all_gather_v {algo}")
        red = torch.zeros(13, device=dev)
        comm.reduce_scatter_v(red, out, [5], [13], algo)
        check(torch.equal(red, mine), f"reduce_scatter_v {algo}")
    print("uneven collectives ok", flush=True)


def train(dev, strategy: str, bf16: bool) -> float:
    torch.manual_seed(0)
    ref = Net().to(dev)
    net = copy.deepcopy(ref)
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        mfsdp.MixedPrecisionPolicy()
    for b in net.blocks:
        mfsdp.fully_shard(b, sharding_strategy=strategy, mp_policy=mp)
    mfsdp.fully_shard(net, sharding_strategy=strategy, mp_policy=mp)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(3):
        x = torch.randn(8, 24, device=dev)
        for model, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16 and model is ref):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            o.step()
            if model is net:
                ours = loss.item()
            else:
                theirs = loss.item()
        worst = max(worst, abs(ours - theirs) / max(abs(theirs), 1e-12))
    full = mfsdp.full_state_dict(net, rank0_only=False, cpu_offload=False)
    tol = 3e-2 if bf16 else 1e-5
    for k, v in ref.state_dict().items():
        check(torch.allclose(full[k].float(), v.float(), rtol=tol, atol=tol), f"{strategy} bf16={bf16}: {k} differs")
    check(worst <= tol, f"{strategy} bf16={bf16}: loss differs by {worst}")
    return worst


def freed_memory(dev) -> None:
    if not _C.freed_storage_guard():
        print(f"freed memory: SKIPPED, torch {torch.__version__} cannot make a freed storage refuse reads "
              "(no StorageImpl::clear_data_ptr_access_error_msg_): a kept unsharded parameter read after "
              "reshard() touches freed memory with this build", flush=True)
        return
    net = Net().to(dev)
    for b in net.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net)
    with torch.no_grad():
        net(torch.randn(2, 24, device=dev))
    block = net.blocks[0]
    block.unshard()
    kept = block[0].weight
    block.reshard()
    try:
        kept.sum().item()
    except RuntimeError as e:
        check("freed by reshard()" in str(e), f"unexpected error: {e}")
    else:
        raise AssertionError("reading a freed unsharded parameter on CUDA did not raise")
    block.unshard()
    check(torch.isfinite(kept).all().item(), "kept parameter unreadable after unshard")
    block.reshard()
    print("freed memory refuses reads ok", flush=True)


def main() -> int:
    # CPU + Gloo when there is no GPU: a quick check of the script itself.
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    fd, init = tempfile.mkstemp(prefix="mfsdp_san_")
    os.close(fd)
    os.unlink(init)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300), device_id=dev if cuda else None)
    kernels(dev)
    uneven_collectives(dev)
    for strategy in STRATEGIES:
        for bf16 in (False, True):
            print(f"train {strategy} bf16={bf16}: worst loss rel diff {train(dev, strategy, bf16):.2e}", flush=True)
    freed_memory(dev)
    if cuda:
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print("sanitizer smoke: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
