"""Test-only: DTensor's collectives through plain c10d calls, for Gloo with CUDA tensors.

torch's functional collectives crash (SIGSEGV in wait_tensor) with CUDA tensors on Gloo in
torch 2.11, the one-GPU machine's build, while the plain c10d collectives work there (the
capability probe, tests/gpu/probe_backends.py). Tensor parallelism redistributes its
DTensors through the functional ones, so the GPU suite's TP tests, whose ranks share one
GPU over Gloo, route them through plain, synchronous c10d calls with the same results. The
library never calls these; under NCCL and on CPU nothing is replaced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}
_routed = False


def _group(group, tag: str = ""):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    raise TypeError(f"route_functional_collectives_through_c10d: group {group!r} is not supported")


def _all_gather(tensor: torch.Tensor, gather_dim: int, group, tag: str = "", *args, **kwargs) -> torch.Tensor:
    pg = _group(group, tag)
    n = dist.get_world_size(pg)
    tensor = tensor.contiguous()
    out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor, group=pg)
    return torch.cat(out.chunk(n, dim=0), dim=gather_dim) if gather_dim != 0 else out


def _reduce_scatter(tensor: torch.Tensor, reduceOp: str, scatter_dim: int, group, tag: str = "", *args,  # noqa: N803
                    **kwargs):
    op = reduceOp
    pg = _group(group, tag)
    n = dist.get_world_size(pg)
    parts = tensor.chunk(n, dim=scatter_dim)
    stacked = torch.cat([p.contiguous().reshape(-1) for p in parts])
    out = torch.empty(parts[0].numel(), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, stacked, op=_OPS[op.lower()] if op.lower() != "avg" else dist.ReduceOp.SUM,
                               group=pg)
    if op.lower() == "avg":
        out /= n
    return out.view(parts[0].shape)


def _all_reduce(tensor: torch.Tensor, reduceOp: str, group, tag: str = "", *args,  # noqa: N803
                **kwargs) -> torch.Tensor:
    op = reduceOp
    pg = _group(group, tag)
    out = tensor.clone()
    dist.all_reduce(out, op=_OPS[op.lower()] if op.lower() != "avg" else dist.ReduceOp.SUM, group=pg)
    if op.lower() == "avg":
        out /= dist.get_world_size(pg)
    return out


def route_functional_collectives_through_c10d() -> None:
    """Replace the functional all-gather / reduce-scatter / all-reduce that DTensor calls
    (whichever names this torch has) in this process. Idempotent."""
    global _routed
    if _routed:
        return
    for name, fn in (("all_gather_tensor", _all_gather), ("all_gather_single", _all_gather),
                     ("reduce_scatter_tensor", _reduce_scatter), ("reduce_scatter_single", _reduce_scatter),
                     ("all_reduce", _all_reduce)):
        if hasattr(funcol, name):
            setattr(funcol, name, fn)
    _routed = True
