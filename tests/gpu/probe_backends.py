"""Re-checks the capability table (csrc/backend.cpp) against this machine's torch: each
collective the table rules on is run by two processes sharing GPU 0 over Gloo (and by one
process under the fake backend), each probe in its own processes so that a crash
(pytorch#152645's SIGSEGV) is recorded, not fatal. Prints a markdown table: what ran,
what the table says, and whether they agree.

Usage (GPU machine, repo root): PYTHONPATH=src:tests python tests/gpu/probe_backends.py [out.md]
PROBE_DEVICE=cpu runs the same probes on CPU tensors against the table's CPU entry.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from harness import DistributedTestError, run_distributed
from megatron_fsdp_ext import _C

WORLD = 2
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")


def _values(rank, n, device):
    return torch.arange(n, dtype=torch.float32, device=device) + 100 * rank


def _probe(rank, world, name, device):
    """Runs collective `name`; returns whether the result is right."""
    g = dist.group.WORLD
    x = _values(rank, 4, device)
    if name == "allgather_into_tensor":
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, x)
        return bool(torch.equal(out.cpu(), torch.cat([_values(r, 4, "cpu") for r in range(world)])))
    if name == "allgather_into_tensor_coalesced":
        outs = [torch.empty(4 * world, device=device), torch.empty(2 * world, device=device)]
        g.allgather_into_tensor_coalesced(outs, [x, x[:2].clone()]).wait()  # the call our C++ makes
        return bool(torch.equal(outs[0].cpu(), torch.cat([_values(r, 4, "cpu") for r in range(world)])))
    if name == "allgather_uneven_list":
        outs = [torch.empty(1 + r, device=device) for r in range(world)]
        dist.all_gather(outs, x[: 1 + rank])
        return all(torch.equal(o.cpu(), _values(r, 1 + r, "cpu")) for r, o in enumerate(outs))
    if name == "reduce_scatter_tensor":
        full = torch.cat([_values(rank, 4, device)] * world)
        out = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(out, full)
        return bool(torch.equal(out.cpu(), sum(_values(r, 4, "cpu") for r in range(world))))
    if name == "reduce_scatter_tensor_coalesced":
        full = torch.cat([_values(rank, 4, device)] * world)
        outs = [torch.empty(4, device=device), torch.empty(4, device=device)]
        g.reduce_scatter_tensor_coalesced(outs, [full, full.clone()]).wait()
        want = sum(_values(r, 4, "cpu") for r in range(world))
        return all(torch.equal(o.cpu(), want) for o in outs)
    if name == "all_to_all_uneven":  # what state dicts' row exchange issues (alltoall_base with splits)
        send = [1 + (rank + q) % 3 for q in range(world)]  # elements for rank q
        recv = [1 + (p + rank) % 3 for p in range(world)]
        inp = torch.cat([torch.full((n,), float(100 * rank + q), device=device) for q, n in enumerate(send)])
        out = torch.empty(sum(recv), device=device)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        want = torch.cat([torch.full((n,), float(100 * p + rank)) for p, n in enumerate(recv)])
        return bool(torch.equal(out.cpu(), want))
    if name == "all_reduce":
        dist.all_reduce(x)
        return bool(torch.equal(x.cpu(), sum(_values(r, 4, "cpu") for r in range(world))))
    raise ValueError(name)


def _our_coalesced(rank, world, device):
    """What our Communicator does for a coalesced all-gather on this backend (the table's
    fallback): must be right and must not crash."""
    comm = _C.Communicator(dist.group.WORLD)
    x = _values(rank, 4, device)
    outs = [torch.empty(4 * world, device=device), torch.empty(2 * world, device=device)]
    comm.all_gather_flat_coalesced(outs, [x, x[:2].clone()])
    return bool(torch.equal(outs[0].cpu(), torch.cat([_values(r, 4, "cpu") for r in range(world)])))


def _training_step(rank, world, system, bf16, force_sum):
    """One forward/backward/AdamW step of a two-block model sharded by `system` (ours or
    torch's FSDP2) on the Gloo group: whether FSDP2 runs there at all (with its division
    inside the collective, or with SUM forced), and ours beside it."""
    from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64)).to(device)
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for m in (*model.blocks, model):
            fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(**dtypes))
            m.set_force_sum_reduction_for_comms(force_sum)
    else:
        import megatron_fsdp_ext as mfsdp
        for m in (*model.blocks, model):
            mfsdp.fully_shard(m, mp_policy=mfsdp.MixedPrecisionPolicy(**dtypes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 8), device=device)
    model.loss(tokens, tokens).backward()
    opt.step()
    torch.cuda.synchronize() if device.type == "cuda" else None
    return True


def _fake_semantics(rank, world, device):
    """Under fake: does an all-gather write its output, does a reduce-scatter?"""
    out = torch.full((4 * world,), -1.0, device=device)
    dist.all_gather_into_tensor(out, _values(rank, 4, device))
    rs = torch.full((4,), -1.0, device=device)
    dist.reduce_scatter_tensor(rs, torch.ones(4 * world, device=device))
    return {"all_gather_writes_output": bool((out != -1).all()), "reduce_scatter_writes_output": bool((rs != -1).all())}


def _run(fn, *args, backend="gloo"):
    try:
        results = run_distributed(fn, WORLD, *args, backend=backend, device=DEVICE, timeout=90)
        return "right" if all(r is True for r in results) else (results[0] if backend == "fake" else "WRONG")
    except DistributedTestError as e:
        text = str(e)
        if "died without a result" in text:
            return "crashed (" + text.split("exit codes")[-1].strip() + ")"
        last = [line for line in text.splitlines() if line.strip()][-1]
        return "refused: " + last.strip()[:140]


def main() -> int:
    caps = _C.known_backend_caps("gloo", torch.device(DEVICE))
    table = {
        "allgather_into_tensor": caps.flat_all_gather,
        "allgather_into_tensor_coalesced": caps.coalesced_all_gather,
        "allgather_uneven_list": caps.uneven_lists,
        "reduce_scatter_tensor": caps.flat_reduce_scatter,
        "reduce_scatter_tensor_coalesced": caps.coalesced_reduce_scatter,
        "all_to_all_uneven": caps.all_to_all,
        "all_reduce": True,
    }
    where = f"{torch.cuda.get_device_name(0)}, {WORLD} processes on cuda:0" if DEVICE == "cuda" else f"{WORLD} processes"
    lines = [f"torch {torch.__version__}, {where} over Gloo", "",
             f"| collective ({DEVICE} tensors) | result | table says supported | agree |", "|---|---|---|---|"]
    disagree = 0
    for name, supported in table.items():
        result = _run(_probe, name, DEVICE)
        ok = (result == "right") == supported
        disagree += not ok
        lines.append(f"| {name} | {result} | {supported} | {'yes' if ok else 'NO'} |")
    ours = _run(_our_coalesced, DEVICE)
    disagree += ours != "right"
    lines.append(f"| our all_gather_flat_coalesced (fallback) | {ours} | - | {'yes' if ours == 'right' else 'NO'} |")
    lines += ["", "| training step over Gloo | result |", "|---|---|"]
    for system, bf16, force_sum in (("fsdp2", False, False), ("fsdp2", True, False), ("fsdp2", True, True),
                                    ("mfsdp", True, False)):
        lines.append(f"| {system} {'bf16/fp32' if bf16 else 'fp32'}{' force_sum' if force_sum else ''} | "
                     f"{_run(_training_step, system, bf16, force_sum)} |")
    fake = _run(_fake_semantics, DEVICE, backend="fake")
    lines += ["", f"fake backend on this torch: {fake}"]
    text = "\n".join(lines)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
