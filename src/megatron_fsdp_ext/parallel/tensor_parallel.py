"""Tensor-parallel (DTensor) parameters inside a fully_shard unit.

A module parallelized with torch's `parallelize_module` (ColwiseParallel, RowwiseParallel,
SequenceParallel, ...) holds DTensor parameters on a "tp" mesh. fully_shard on it, with
`mesh` the data-parallel mesh of the same job (world_mesh["dp_shard"], or HSDP's
("dp_replicate", "dp_shard")), keeps each parameter's local TP shard in the unit's flat
buffer and shards that over the data-parallel ranks, as FSDP2 does:

- forward and backward see DTensors with the TP spec the parameter came with (wrappers
  around the unit's unsharded local views, made once), so TP's own collectives run as they
  would without FSDP;
- each gradient arrives on the wrapper as a DTensor; `move_grads` redistributes it to the
  parameter's TP placements (a Partial gradient, e.g. a norm weight under sequence
  parallel, is summed over tp) and hands the local part to the unit, which reduces over the
  data-parallel ranks only;
- state dicts place each value as FSDP2+TP does: on the (dp..., tp) mesh, the data-parallel
  dim chunking the local shard's dim 0 (`_StridedShard` where TP shards dim 0 too).

The optimizer keeps updating plain 1-D shards of the local tensors. What this cannot serve
(TP meshes of more than one dim, Partial or strided TP placements, uneven TP shards, a TP
mesh that is not part of the data-parallel mesh's job mesh or has no dim names) raises
naming the parameter.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..core.extension_points import OuterSharding, register_outer_sharding
from ..core.dtensor_face import is_dtensor


@dataclasses.dataclass(frozen=True)
class TPSpec:
    """One DTensor parameter's tensor-parallel layout: what its wrapper is built from."""
    placements: Tuple  # on the TP mesh (one dim)
    shape: torch.Size  # the global shape
    stride: Tuple[int, ...]  # the global (contiguous) stride

    @property
    def sharded(self) -> bool:
        """Whether TP splits the parameter (each tp rank holds different values)."""
        return any(isinstance(p, Shard) for p in self.placements)


class TensorParallelParams:
    """The DTensor parameters of one unit, all on one TP mesh, and the (dp..., tp) mesh
    their state-dict values live on. Built by fully_shard (construct.py) before the unit."""

    def __init__(self, specs: Dict[int, TPSpec], tp_mesh: DeviceMesh, spmd_mesh: DeviceMesh, dp_ndim: int):
        self.specs = specs
        self.tp_mesh = tp_mesh
        self.spmd_mesh = spmd_mesh
        self.dp_ndim = dp_ndim  # the data-parallel dims leading spmd_mesh (2 under HSDP)

    @property
    def tp_group(self):
        return self.tp_mesh.get_group()

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size()

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank()

    # ------------------------------------------------------------ the unit's view

    def wrap(self, index: int, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The parameter forward and backward see for parameter `index`: a DTensor with its
        TP spec around `local` (the unit's unsharded view; the wrapper shares its storage,
        so every gather fills it)."""
        with torch.no_grad():
            wrapped = self.full_of_local(index, local)
        return nn.Parameter(wrapped, requires_grad=requires_grad)

    def move_grads(self, unit) -> None:
        """Each wrapper's gradient (a DTensor) as the unit reads it: redistributed to the
        parameter's TP placements (Partial sums over tp here), its local part moved onto
        the unit's local view (added to one left there)."""
        holders = unit.unsharded_locals
        for index, spec in self.specs.items():
            wrapper = unit.unsharded_param(index)
            grad = wrapper.grad
            if grad is None:
                continue
            wrapper.grad = None
            if not is_dtensor(grad):
                raise RuntimeError(f"the gradient of tensor-parallel parameter '{unit.param_spec(index).name}' is a "
                                   f"{type(grad).__name__}, expected a DTensor like the parameter")
            if tuple(grad.placements) != spec.placements:
                grad = grad.redistribute(placements=spec.placements)
            local = grad.to_local()
            wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor from the redistribute
            if callable(wait):
                local = wait()
            holder = holders[index]
            holder.grad = local if holder.grad is None else holder.grad + local

    # ------------------------------------------------------------ state dicts

    def placements(self, index: int, dp_placements: List) -> Tuple:
        """FSDP2+TP's placements for a value of parameter `index` on spmd_mesh, from ours on
        the data-parallel dims (HSDP's Replicate, then Shard(dim)): a data-parallel shard of
        a dim TP shards too is strided by TP's shards, which it nests inside."""
        spec = self.specs[index]
        dp = list(dp_placements)
        last = dp[-1]
        if isinstance(last, Shard):
            split = 1
            for p in spec.placements:
                if isinstance(p, Shard) and p.dim == last.dim:
                    split *= self.tp_size
            if split > 1:
                dp[-1] = _StridedShard(last.dim, split_factor=split)
        return (*dp, *spec.placements)

    def local_of_full(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard (the unit's local shape) of a full value of parameter
        `index`: the TP spec's equal chunks (uneven shards are refused at construction)."""
        spec = self.specs[index]
        local = full
        for p in spec.placements:
            if isinstance(p, Shard):
                local = local.chunk(self.tp_size, dim=p.dim)[self.tp_rank]
        return local

    def local_value(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """What the unit keeps of a value given for parameter `index` in its full shape: a
        DTensor placed as the parameter gives its local part, another DTensor is gathered
        first, a plain tensor of the full shape is cut. Anything else is passed on as it is
        (the unit refuses shapes it cannot place)."""
        spec = self.specs[index]
        if is_dtensor(value):
            if value.device_mesh == self.tp_mesh and tuple(value.placements) == spec.placements \
                    and value.shape == spec.shape:
                return value.to_local()
            value = value.full_tensor()
        if tuple(value.shape) != tuple(spec.shape):
            return value
        return self.local_of_full(index, value)

    def full_of_local(self, index: int, local: torch.Tensor) -> DTensor:
        """A full value's DTensor on the TP mesh from this rank's local part (materialize:
        the initializer runs on it as on the parameter TP alone gives)."""
        spec = self.specs[index]
        return DTensor.from_local(local, self.tp_mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)


def _spec_of(p: DTensor, name: str, tp_mesh: DeviceMesh) -> TPSpec:
    placements = tuple(p.placements)
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise NotImplementedError(
                f"fully_shard: tensor-parallel parameter '{name}' is placed {placement} on its mesh; units hold "
                "parameters placed Shard(dim) or Replicate() on a one-dimensional TP mesh")
    size = tp_mesh.size()
    for placement in placements:
        if isinstance(placement, Shard) and p.shape[placement.dim] % size != 0:
            raise ValueError(
                f"fully_shard: tensor-parallel parameter '{name}' of shape {tuple(p.shape)} is split unevenly by "
                f"Shard({placement.dim}) over {size} tp ranks ({p.shape[placement.dim]} is not a multiple of {size}); "
                "make that dim divisible by the TP degree")
    return TPSpec(placements=placements, shape=p.shape, stride=tuple(p.stride()))


def _joined(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh, as FSDP2 builds it: torch's mesh concatenation (which refuses
    meshes of different job meshes and overlapping dims), or on torch builds without it the
    job mesh sliced by both meshes' dim names."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([dp_mesh, tp_mesh])
    root = dp_mesh._get_root_mesh()
    if tp_mesh._get_root_mesh() is not root:
        raise RuntimeError("the meshes come from different job meshes")
    return root[tuple(dp_mesh.mesh_dim_names) + tuple(tp_mesh.mesh_dim_names)]


def _described(mesh: DeviceMesh) -> str:
    """A mesh as errors name it: its dim names (if any) and ranks."""
    return f"{mesh.mesh_dim_names or '(no dim names)'} {mesh.mesh.tolist()}"


def collect(params: list, names: list, mesh: Optional[DeviceMesh]) -> Optional[TensorParallelParams]:
    """The unit's DTensor parameters checked against the data-parallel `mesh`, or None when
    it has none. They must share one 1-D TP mesh drawn from the same job mesh as `mesh`,
    with dims of its own, every dim named."""
    dtensors = [(i, p) for i, p in enumerate(params) if is_dtensor(p)]
    if not dtensors:
        return None
    first = names[dtensors[0][0]]
    tp_mesh = dtensors[0][1].device_mesh
    for i, p in dtensors:
        if p.device_mesh.ndim != 1:
            raise NotImplementedError(
                f"fully_shard: parameter '{names[i]}' is a DTensor on the {p.device_mesh.ndim}-D mesh "
                f"{p.device_mesh.mesh_dim_names}; units take tensor-parallel parameters on a one-dimensional mesh")
        if p.device_mesh != tp_mesh:
            raise ValueError(
                f"fully_shard: parameters '{first}' and '{names[i]}' are DTensors on different meshes "
                f"({tp_mesh.mesh_dim_names} {tp_mesh.mesh.tolist()} and {p.device_mesh.mesh_dim_names} "
                f"{p.device_mesh.mesh.tolist()}); a unit's tensor-parallel parameters share one TP mesh")
    if mesh is None:
        raise ValueError(
            f"fully_shard: parameter '{first}' is a DTensor (tensor parallel on mesh {tp_mesh.mesh_dim_names}); pass "
            "the data-parallel mesh of the same job as mesh= (e.g. world_mesh['dp_shard'], or world_mesh["
            "('dp_replicate', 'dp_shard')] for HSDP), not a process group")
    if mesh.device_type != tp_mesh.device_type:
        raise ValueError(f"fully_shard: the data-parallel mesh is on {mesh.device_type} but parameter '{first}' is a "
                         f"DTensor on a {tp_mesh.device_type} mesh")
    dp_names = set(mesh.mesh_dim_names or ())
    # Ranks, not only names: unnamed meshes over the same ranks overlap just as well. In a
    # (dp..., tp) mesh this rank is the only one its dp and tp slices have in common.
    shared_ranks = set(mesh.mesh.flatten().tolist()) & set(tp_mesh.mesh.flatten().tolist())
    if dp_names & set(tp_mesh.mesh_dim_names or ()) or len(shared_ranks) > 1:
        raise ValueError(f"fully_shard: the tensor-parallel mesh {_described(tp_mesh)} of parameter '{first}' "
                         f"shares a dimension with the data-parallel mesh {_described(mesh)} (ranks "
                         f"{sorted(shared_ranks)} in both); slice them as different dims of one job mesh")
    unnamed = [what for what, m in (("data-parallel", mesh), ("tensor-parallel", tp_mesh)) if not m.mesh_dim_names]
    if unnamed:
        # torch joins the two into the (dp..., tp) mesh of state-dict values by dim name
        # (FSDP2 needs the names too), so unnamed dims cannot be placed.
        lacking = f"the {' and '.join(unnamed)} mesh{'es have' if len(unnamed) > 1 else ' has'} no dim names"
        raise ValueError(
            f"fully_shard: parameter '{first}' is a DTensor on the tensor-parallel mesh {_described(tp_mesh)} and "
            f"the data-parallel mesh is {_described(mesh)}: {lacking}, which joining them into the (dp..., tp) mesh "
            "of state dicts needs; build one mesh with init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp')) "
            "and pass mesh['dp_shard'] to fully_shard and mesh['tp'] to parallelize_module")
    try:
        spmd_mesh = _joined(mesh, tp_mesh)
    except (RuntimeError, KeyError, ValueError) as e:
        raise ValueError(
            f"fully_shard: the tensor-parallel mesh {tp_mesh.mesh_dim_names} {tp_mesh.mesh.tolist()} of parameter "
            f"'{first}' and the data-parallel mesh {mesh.mesh_dim_names} {mesh.mesh.tolist()} are not dims of one "
            f"job mesh ({e}); build one mesh with init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp')) and pass "
            "mesh['dp_shard'] to fully_shard and mesh['tp'] to parallelize_module") from None
    specs = {i: _spec_of(p, names[i], tp_mesh) for i, p in dtensors}
    return TensorParallelParams(specs, tp_mesh, spmd_mesh, mesh.ndim)


def local_tensors(params: list) -> list:
    """What the unit holds of each parameter: a DTensor's local TP shard, else itself."""
    with torch.no_grad():
        return [p.to_local() if is_dtensor(p) else p for p in params]


class TensorParallelSharding(OuterSharding):
    """This module as the core's outer sharding (core/extension_points.py)."""

    def collect(self, params, names, mesh):
        return collect(params, names, mesh)

    def local_tensors(self, params):
        return local_tensors(params)


register_outer_sharding(TensorParallelSharding())
