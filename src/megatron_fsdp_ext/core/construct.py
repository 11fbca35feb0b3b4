"""How fully_shard builds a unit: the checks on its arguments, the parameters it claims,
the device their shards live on, the C++ Unit and its communicators. api.fully_shard
calls these in order; nothing here keeps state except the cache of created groups."""
from __future__ import annotations

import datetime
import os
import warnings
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import _C
from . import backends
from .extension_points import gather_transform, outer_sharding, user_attributes
from .options import FLOAT_DTYPES, as_timeout
from .sharded_param import ShardedParameter, refuse_gradients_into_piece

def groups_from_mesh(mesh, process_group):
    """(shard group, replicate group or None) from fully_shard's mesh/process_group.
    A 2-D mesh follows FSDP2: dim 0 replicates, dim 1 shards (HSDP)."""
    if mesh is None:
        return process_group, None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if process_group is not None:
        raise ValueError("pass either mesh or process_group, not both")
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim != 2:
        raise ValueError(
            f"fully_shard(mesh=...) takes a 1-D mesh (FSDP) or a 2-D mesh (replicate, shard) for hybrid "
            f"sharding; got a {mesh.ndim}-D mesh {mesh.mesh_dim_names or ''} (flatten or slice it first)")
    rows = mesh.mesh
    if not bool((rows.sort(dim=-1).values == rows).all()):
        # Groups order their ranks ascending: a row listed otherwise would pair each shard
        # with another replica's different segment in the all-reduce across replicas.
        raise ValueError(f"fully_shard(mesh=...): every shard row of the mesh must list its ranks in "
                         f"ascending order, got {rows.tolist()}")
    return mesh.get_group(1), mesh.get_group(0)


def mesh_covers_job(mesh) -> bool:
    """Whether `mesh.mesh` lists every rank of the job (not a slice of a larger mesh, where
    other ranks would see other rows and groups made from them would differ)."""
    return mesh.mesh.numel() == dist.get_world_size()


def offload_pinning(offload_policy) -> Optional[bool]:
    """FSDP2's offload_policy: None or OffloadPolicy() keep the unit on its device (None
    returned); CPUOffloadPolicy(pin_memory=...) keeps its shard, gradient and optimizer
    state in host memory, the value returned says whether pinned."""
    if offload_policy is None:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(offload_policy, CPUOffloadPolicy):
        if not isinstance(offload_policy.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy(pin_memory={offload_policy.pin_memory!r}): pin_memory must be a bool")
        return offload_policy.pin_memory
    if type(offload_policy) is OffloadPolicy:
        return None
    raise TypeError(f"offload_policy must be None, OffloadPolicy() or CPUOffloadPolicy(pin_memory=...), "
                    f"got {offload_policy!r}")


class PlacementGroup(NamedTuple):
    """Parameters of one fully_shard call that share a mesh: one unit each. FSDP2's
    shard_placement_fn may put some on another mesh (ShardPlacementResult: MoE experts on
    the expert data-parallel mesh), as FSDP2 makes one parameter group per mesh."""
    mesh: Optional[object]  # a DeviceMesh; None: the call's own mesh / process group
    indices: List[int]  # into the call's parameters, ascending
    dims: Optional[List[int]]  # per parameter, the dim its state-dict DTensors shard; None: all 0


def _mesh_of_result(result, name: str):
    """The DeviceMesh of FSDP2's ShardPlacementResult.mesh_info (FSDPMeshInfo: a 1-D mesh
    that shards; HSDPMeshInfo: a 2-D (replicate, shard) mesh), checked to be one
    fully_shard(mesh=) takes the same way."""
    info = result.mesh_info
    mesh = getattr(info, "mesh", None)
    shard_dim, replicate_dim = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    if getattr(info, "is_spmd_mesh", False):
        raise NotImplementedError(
            f"shard_placement_fn gave parameter '{name}' a mesh_info on an SPMD mesh (dp_mesh_dims); parameters "
            "that are DTensors on every axis of one mesh are not supported (torchtitan: spmd_backend="
            "'partial_dtensor')")
    if mesh is None or shard_dim is None:
        raise ValueError(f"shard_placement_fn returned {result!r} for parameter '{name}': its mesh_info must shard "
                         "over a mesh (FSDPMeshInfo or HSDPMeshInfo)")
    if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise NotImplementedError(
            f"shard_placement_fn gave parameter '{name}' the {mesh.ndim}-D mesh {mesh.mesh_dim_names} sharding on "
            f"dim {shard_dim} and replicating on dim {replicate_dim}; units take a 1-D mesh that shards, or a 2-D "
            "(replicate, shard) mesh, as fully_shard(mesh=) does")
    return mesh


def _shard_dim(placement, p, name: str, result) -> int:
    from torch.distributed.tensor import Shard

    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(f"shard_placement_fn returned {result!r} for parameter '{name}': only Shard(dim), None "
                         "(Shard(0)) or a ShardPlacementResult of those shard a parameter over a data-parallel group")
    dim = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < max(p.dim(), 1) or (p.dim() == 0 and placement.dim != 0):
        raise ValueError(f"shard_placement_fn returned Shard({placement.dim}) for parameter '{name}' of shape "
                         f"{tuple(p.shape)}, which has no dim {placement.dim}")
    return dim


def placement_groups(params: list, names: list, shard_placement_fn, call_groups) -> List[PlacementGroup]:
    """FSDP2's shard_placement_fn, per parameter: None (Shard(0)), Shard(dim) (the dim its
    state-dict DTensors shard; a unit shards one flat buffer whatever the dim, so training
    is the same), or a ShardPlacementResult whose mesh_info puts it on another mesh. The
    call's parameters grouped by the groups they shard over, the call's own first;
    `call_groups` is the call's (shard group, replicate group or None)."""
    if shard_placement_fn is None:
        return [PlacementGroup(None, list(range(len(params))), None)]
    if not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable, got {type(shard_placement_fn).__name__}")
    own, others = PlacementGroup(None, [], []), {}
    for i, (p, name) in enumerate(zip(params, names)):
        result = shard_placement_fn(p)
        group = own
        placement = result
        if hasattr(result, "mesh_info") and hasattr(result, "placement"):  # torch's ShardPlacementResult
            mesh = _mesh_of_result(result, name)
            placement = result.placement
            shard_pg = mesh.get_group(mesh.ndim - 1)
            replicate_pg = mesh.get_group(0) if mesh.ndim == 2 else None
            if (shard_pg, replicate_pg) != tuple(call_groups):
                key = (shard_pg, replicate_pg)
                group = others.setdefault(key, PlacementGroup(mesh, [], []))
        group.indices.append(i)
        group.dims.append(_shard_dim(placement, p, name, result))
    groups = [own] if own.indices or not others else []
    return groups + list(others.values())


# Second communicator per process group for all-gathers, created once and cached so
# that all-gather and reduce-scatter can run concurrently (NCCL serialises the
# collectives of one communicator). Groups with a bounded timeout (fully_shard(timeout=))
# are cached the same way, one per role: separate all-gather and reduce-scatter groups
# also make a rank that skipped backward wait in the other collective instead of
# pairing mismatched ones.
_GROUPS: dict = {}


def group_for(pg, role: str, timeout: Optional[datetime.timedelta] = None, shard_groups=None):
    """The cached `role` communicator over pg's ranks. new_group() is collective over the
    default group, so when pg is one of several shard groups (HSDP), `shard_groups` lists
    the ranks of all of them and every rank creates them all, in the same order."""
    ranks = tuple(dist.get_process_group_ranks(pg))
    rows = tuple(tuple(r) for r in shard_groups) if shard_groups is not None else (ranks,)
    key = (dist.get_backend(pg), rows, role, timeout)
    if key not in _GROUPS:
        extra = {} if timeout is None else {"timeout": timeout}
        made = {row: dist.new_group(ranks=list(row), backend=key[0], **extra) for row in rows}
        _GROUPS[key] = made[ranks]
    return _GROUPS[key]


def post_forward_size_of(reshard_after_forward, shard_size: int):
    """fully_shard's reshard_after_forward as (bool or None, N): FSDP2's int form N, a factor
    of the shard group's size, is True keeping 1/N after forward; 1 reads as False, as in
    FSDP2. N is 0 for the bool forms. N stays as given where it is the group's size (True
    for that group): each unit on another mesh (shard_placement_fn) reads it by its own."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, 0
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    n = reshard_after_forward
    if n < 1 or n > shard_size or shard_size % n:
        raise ValueError(f"reshard_after_forward={n}: an int must be a factor of the shard group's size "
                         f"{shard_size} (how many consecutive ranks hold the parameters whole after forward)")
    if n == 1:
        warnings.warn("reshard_after_forward=1 (an int) keeps the gathered parameters whole after forward, as "
                      "reshard_after_forward=False does; pass False", stacklevel=3)
        return False, 0
    return True, n


def post_forward_group(pg, size: int, timeout: Optional[datetime.timedelta] = None):
    """The cached group of the `size` consecutive ranks of pg that this rank's post-forward
    copy is gathered over (reshard_after_forward=int). Created by its members only
    (use_local_synchronization), so shard groups that are slices of a larger job (tensor or
    pipeline parallel, expert meshes) need nothing from the other ranks."""
    ranks = dist.get_process_group_ranks(pg)
    start = ranks.index(dist.get_rank()) // size * size
    chunk = tuple(ranks[start:start + size])
    key = (dist.get_backend(pg), (chunk,), "post_forward", timeout)
    if key not in _GROUPS:
        extra = {} if timeout is None else {"timeout": timeout}
        _GROUPS[key] = dist.new_group(ranks=list(chunk), backend=key[0], use_local_synchronization=True, **extra)
    return _GROUPS[key]


def check_devices(module: nn.Module, params: list, names: list, pg, mesh=None,
                  offload: bool = False) -> Optional[torch.device]:
    """Checks that the parameters sit on one device the group's backend communicates; for
    meta parameters (deferred init) returns the device their shards are allocated on, as
    FSDP2 does: the mesh's device type; without a mesh the current CUDA device when CUDA
    is available and the backend communicates CUDA tensors, else the CPU. Offloaded
    (`offload`), parameters on the CPU are fine too: the unit then computes on that same
    device, which is returned when it is not the CPU."""
    devices = {p.device for p in params}
    kinds = backends.device_types(pg)
    if not kinds:
        raise ValueError(f"fully_shard: the process group's backend '{backends.backend_name(pg)}' communicates "
                         "neither cpu nor cuda tensors")
    if len(devices) > 1 and any(d.type == "meta" for d in devices):
        meta = next(n for p, n in zip(params, names) if p.is_meta)
        real = next(n for p, n in zip(params, names) if not p.is_meta)
        raise ValueError(
            f"fully_shard({type(module).__name__}): parameter '{meta}' is on the meta device but '{real}' is "
            "not; for deferred init build the whole module under torch.device('meta'), then call "
            "megatron_fsdp_ext.materialize(model) after fully_shard")
    if len(devices) > 1:
        by_dev = {}
        for p, n in zip(params, names):
            by_dev.setdefault(str(p.device), n)
        listing = ", ".join(f"'{n}' on {d}" for d, n in by_dev.items())
        raise ValueError(
            f"fully_shard({type(module).__name__}): parameters are on different devices ({listing}); "
            "move the module to one device first"
        )
    device = next(iter(devices))
    if device.type == "meta" or (offload and device.type == "cpu"):
        kind = mesh.device_type if mesh is not None else \
            "cuda" if "cuda" in kinds and torch.cuda.is_available() else "cpu"
        if kind not in kinds:
            raise ValueError(f"fully_shard({type(module).__name__}): meta parameters would be materialized on "
                             f"{kind}, which the process group's backend '{backends.backend_name(pg)}' does not "
                             f"communicate ({'/'.join(sorted(kinds))})")
        if device.type == "cpu" and kind == "cpu":
            return None  # an offloaded unit computing on the CPU: nothing to move
        return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    if device.type not in kinds:
        raise ValueError(
            f"fully_shard({type(module).__name__}): parameters are on {device} but the process group's "
            f"backend '{backends.backend_name(pg)}' communicates {'/'.join(sorted(kinds))} tensors; "
            f"move the module to {'cuda' if 'cuda' in kinds else 'cpu'} first"
        )
    if device.type == "cuda":
        current = torch.cuda.current_device()
        if device.index != current:
            raise ValueError(
                f"fully_shard({type(module).__name__}): parameters are on {device} but the current CUDA "
                f"device is cuda:{current}; call torch.cuda.set_device(local_rank) before building the model"
            )
    return None


def _refuse_torch_fsdp2_module(module: nn.Module, prefix: str) -> None:
    """A module torch's own fully_shard sharded holds FSDP2's DTensor parameters and hooks,
    which our unit can neither take over nor drive (both would gather and reduce them)."""
    if isinstance(module, FSDPModule) and "_mfsdp_state" not in module.__dict__:
        where = f"module '{prefix[:-1]}'" if prefix else "this module"
        raise ValueError(
            f"fully_shard: {where} ({type(module).__name__}) was sharded by torch's own fully_shard "
            "(FSDP2); one model cannot mix FSDP2's units with ours. Shard every module with "
            "megatron_fsdp_ext.fully_shard (it takes FSDP2's arguments), or every module with torch's")


def collect_params(modules: list, ignored: frozenset):
    """The parameters this call owns (the unit of `modules`: one, or FSDP2's list of
    several) and every slot (module._parameters, name) holding them; the state-dict keys
    per module, relative to it.

    Subtrees of already-sharded modules belong to their own units and are skipped; a
    parameter of such a unit found outside it is a tie across units, which one unit's
    swap could not serve, so it is refused.
    """
    params, names, index_of = [], [], {}
    slots = []  # (params_dict, name, index)
    keys = []  # per module: (state_dict key relative to it, index): every slot, tied ones included

    # An explicit stack, not a recursive closure: a closure that calls itself is a
    # reference cycle, which would keep `params` (the unsharded originals) alive until the
    # garbage collector runs instead of freeing them when the unit replaces them.
    for k, module in enumerate(modules):
        # A unit of several modules names its parameters by the module's position.
        top = f"{k}." if len(modules) > 1 else ""
        keys.append([])
        stack = [(module, top, True)]
        while stack:
            mod, prefix, is_top = stack.pop()
            if not is_top and "_mfsdp_state" in mod.__dict__:
                continue
            _refuse_torch_fsdp2_module(mod, top + prefix)
            for name, p in mod._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                # _mfsdp_owner marks both the sharded parameter and the original it replaced
                # (a tied original can still sit in a module outside the unit's subtree).
                owner = getattr(p, "_mfsdp_owner", None)
                if owner is not None:
                    raise ValueError(
                        f"parameter '{prefix}{name}' of the {type(mod).__name__} passed to fully_shard"
                        f"{'' if mod is module else f' (inside a {type(module).__name__})'} already belongs to "
                        f"the fully_shard unit of "
                        f"{owner()!s}: either fully_shard was applied to an ancestor before this module "
                        "(call fully_shard bottom-up: inner modules first, then the root), or the parameter "
                        "is tied to a module of another unit (tied parameters must live in one unit)"
                    )
                if id(p) not in index_of:
                    index_of[id(p)] = len(params)
                    params.append(p)
                    names.append(prefix + name)
                slots.append((mod._parameters, name, index_of[id(p)]))
                keys[-1].append((prefix[len(top):] + name, index_of[id(p)]))
            # Children in reverse onto the stack: visited in registration order, depth first.
            stack.extend((child, f"{prefix}{child_name}.", False)
                         for child_name, child in reversed(list(mod._modules.items())) if child is not None)
    return params, names, slots, keys


def check_target(module) -> list:
    """The modules of the unit: `module`, or FSDP2's list of several (gathered before the
    first of them runs, resharded after the last). Each an nn.Module not sharded yet,
    none inside another, with torch.distributed up."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module{' in its list' if len(modules) > 1 else ''}, "
                            f"got {type(m).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
        )
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")
    for m in modules:
        if "_mfsdp_state" in m.__dict__:
            raise ValueError(f"fully_shard was already called on this {type(m).__name__} module")
        for other in modules:
            if other is not m and any(sub is other for sub in m.modules()):
                raise ValueError(f"fully_shard([...]): {type(other).__name__} is inside {type(m).__name__}; a unit of "
                                 "several modules takes modules that do not contain each other")
        _refuse_writes_in_forward(m)
    return modules


def _refuse_writes_in_forward(module: nn.Module) -> None:
    """Modules that write their own weight during forward: the write would land in the
    gathered copy, which is freed after the unit's forward, so the shard never sees it;
    and embeddings whose gradient is sparse, which no unit can reduce."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None:
            raise NotImplementedError(
                f"fully_shard: {name or 'the module'} is an {type(sub).__name__} with max_norm={sub.max_norm}, "
                "which renormalizes the rows it looks up in its weight, in place, during forward; under "
                "fully_shard that write lands in the gathered copy and is lost (FSDP2 loses it too), and ranks "
                "looking up different rows would write different values. Build it without max_norm")
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise NotImplementedError(
                f"fully_shard: {name or 'the module'} is an {type(sub).__name__} with sparse=True, whose weight "
                "gets a sparse gradient; a unit reduce-scatters dense gradient buffers (FSDP2 cannot reduce a "
                "sparse one either). Build it with sparse=False")


class CommGroups:
    """The groups a unit communicates on, checked together before any work: the shard
    group `pg`, the replicate group (HSDP), explicit or created all-gather and
    reduce-scatter groups, and the collective timeout they are created with."""

    def __init__(self, pg, replicate_group, mesh, all_gather_group, reduce_scatter_group,
                 create_all_gather_group: Optional[bool], timeout):
        for what, group in (("all_gather_group", all_gather_group), ("reduce_scatter_group", reduce_scatter_group)):
            if group is not None and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(pg):
                raise ValueError(
                    f"{what} spans ranks {dist.get_process_group_ranks(group)} but the process group parameters "
                    f"are sharded over spans {dist.get_process_group_ranks(pg)}; it must hold the same ranks in "
                    "the same order"
                )
        if all_gather_group is not None and create_all_gather_group:
            raise ValueError("pass either all_gather_group or create_all_gather_group=True, not both")
        timeout = as_timeout(timeout)
        if timeout is not None and (all_gather_group is not None or reduce_scatter_group is not None):
            raise ValueError("pass either timeout= or explicit all_gather_group/reduce_scatter_group, not both "
                             "(create your groups with torch.distributed.new_group(..., timeout=...) instead)")
        if timeout is not None and dist.get_world_size(pg) != dist.get_world_size() and \
                (replicate_group is None or not mesh_covers_job(mesh)):
            raise ValueError("timeout= needs a process group spanning all ranks (new_group is collective over "
                             "the default group); for a subgroup, create groups with new_group(..., timeout=...) "
                             "on every rank and pass them as all_gather_group= and reduce_scatter_group=")
        self.pg, self.replicate_group, self.mesh = pg, replicate_group, mesh
        self.all_gather_group, self.reduce_scatter_group = all_gather_group, reduce_scatter_group
        self.create_all_gather_group, self.timeout = create_all_gather_group, timeout

    def connect(self, unit, strategy, post_forward_size: int = 0) -> None:
        """Give `unit` its communicators, creating (and caching) those it needs: groups
        with the timeout, an all-gather group of its own where collectives overlap, and the
        post-forward group of reshard_after_forward=int (`post_forward_size` ranks)."""
        pg, mesh, timeout = self.pg, self.mesh, self.timeout
        replicate_group = self.replicate_group
        # HSDP: the mesh's shard groups, one per replica, so that groups made for one
        # can be made for all (new_group is collective over the job).
        shard_groups = (mesh.mesh.reshape(-1, mesh.size(1)).tolist()
                        if replicate_group is not None and mesh_covers_job(mesh) else None)
        if timeout is not None and dist.get_world_size(pg) > 1:
            self.reduce_scatter_group = group_for(pg, "reduce_scatter", timeout, shard_groups)
            if strategy.gathers:
                self.all_gather_group = group_for(pg, "all_gather", timeout, shard_groups)
        if timeout is not None and replicate_group is not None and shard_groups is not None:
            replicate_groups = mesh.mesh.reshape(-1, mesh.size(1)).t().tolist()
            replicate_group = group_for(replicate_group, "replicate", timeout, replicate_groups)
        if self.all_gather_group is None:
            # new_group() is collective over the default group, so only a group spanning
            # the whole job gets one automatically; per-rank subgroups (expert-parallel,
            # ...) must pass all_gather_group explicitly.
            spans_job = dist.get_world_size(pg) == dist.get_world_size() or shard_groups is not None
            create = self.create_all_gather_group
            if create is None:
                create = backends.overlaps_collectives(pg, unit.device) and spans_job
            if create and strategy.gathers and dist.get_world_size(pg) > 1:
                if not spans_job:
                    raise ValueError(
                        "create_all_gather_group=True needs a process group spanning all ranks "
                        "(new_group is collective over the default group); for a subgroup, create the "
                        "all-gather group on every rank yourself and pass all_gather_group="
                    )
                self.all_gather_group = group_for(pg, "all_gather", shard_groups=shard_groups)
        if post_forward_size:
            world = dist.get_world_size(pg)
            if world % post_forward_size:
                where = f"mesh {mesh.mesh_dim_names or tuple(mesh.shape)}" if mesh is not None else "process group"
                raise ValueError(f"reshard_after_forward={post_forward_size}: parameters on the {where} are sharded "
                                 f"over {world} ranks, of which {post_forward_size} is not a factor")
            if world > post_forward_size:  # the whole group: plain resharding
                unit.set_post_forward_group(post_forward_group(pg, post_forward_size, timeout))
        if replicate_group is not None:
            unit.set_replicate_group(replicate_group)
        if self.all_gather_group is not None:
            unit.set_all_gather_group(self.all_gather_group)
        if self.reduce_scatter_group is not None:
            unit.set_reduce_scatter_group(self.reduce_scatter_group)


def make_unit(params: list, names: list, pg, alignment: int, mp_policy, strategy, materialize_on,
              check_for_nan_in_grad: bool, tp=None, offload_pin: Optional[bool] = None, label: Optional[str] = None):
    """The C++ Unit over `params`, bound to the parameter objects the module will show:
    sharded (1-D views of this rank's shard) and unsharded (views of the gathered buffer),
    both keeping the originals' requires_grad and user attributes. The unit is their one
    holder (unit.sharded_params / unsharded_params). Tensor-parallel parameters (`tp`,
    tensor_parallel.py) are held as their local TP shards and shown unsharded as DTensors
    wrapping the unit's views."""
    transform = gather_transform()  # FP8/MX weights (precision/fp8.py), else plain
    held = outer_sharding().local_tensors(params)  # a DTensor's local TP shard, else the parameter
    fp8_weights = [transform.weight_of(inner) for inner in held]  # torchao asked for an FP8 gather
    for p, inner, n, w in zip(params, held, names, fp8_weights):
        if w is not None and inner is not p:
            raise NotImplementedError(
                f"fully_shard: parameter '{n}' is a tensor-parallel DTensor of torchao's FP8-gathered weight; the FP8 "
                "all-gather does not combine with tensor parallelism yet. Convert with Float8LinearConfig("
                "enable_fsdp_float8_all_gather=False) to gather in the param dtype")
        if w is None and transform.master_of(inner) is inner and \
                (hasattr(inner, "fsdp_pre_all_gather") or hasattr(inner, "fsdp_post_all_gather")):
            # FSDP2's all-gather extension (torchao's FP8 gather among others): gathering
            # the plain values instead would train, but not as the subclass asked.
            raise NotImplementedError(
                f"fully_shard: parameter '{n}' is a {type(inner).__name__}, which defines FSDP2's all-gather "
                "extension (fsdp_pre_all_gather / fsdp_post_all_gather); units do not run other subclasses' "
                "gathers. torchao's FP8-gathered Float8Linear weights are supported")
        if p.dtype not in FLOAT_DTYPES:
            kind = "unsupported floating" if p.is_floating_point() else "complex" if p.is_complex() else "non-floating"
            # A complex piece would have to be cut between whole (real, imaginary) pairs and
            # viewed back on every path that hands values out: refused, not half-supported.
            hint = ("; keep it as real pairs instead (nn.Parameter(torch.view_as_real(w)), and "
                    "torch.view_as_complex(self.w) in forward)") if p.is_complex() else ""
            raise ValueError(f"fully_shard: parameter '{n}' has {kind} dtype {p.dtype}; units hold "
                             f"{', '.join(str(d) for d in FLOAT_DTYPES)} parameters{hint}")
    masters = [transform.master_of(h) for h in held]
    unit = _C.Unit([m.detach() for m in masters], names, pg, transform.alignment_for(alignment, fp8_weights),
                   mp_policy.param_dtype, mp_policy.reduce_dtype, strategy, materialize_on)
    transform.configure(unit, fp8_weights, names)
    if label is not None:  # errors before the root's lazy init (offload's below) name the unit as FSDPState does
        unit.set_label(label)
    if offload_pin is not None:
        unit.offload_to_host(offload_pin)
    param_dtype = mp_policy.param_dtype or masters[0].dtype
    sharded, unsharded = [], []
    locals_ = unit.unsharded_views()
    mx_scales = unit.mx_scale_views() if unit.mx_block else None
    for i, (p, sview, uview) in enumerate(zip(params, unit.sharded_views(), locals_)):
        s = ShardedParameter(sview, requires_grad=p.requires_grad)
        refuse_gradients_into_piece(s)
        if tp is not None and i in tp.specs:
            u = tp.wrap(i, uview, p.requires_grad)
        elif fp8_weights[i] is not None:
            u = transform.unsharded_param(unit, i, uview, fp8_weights[i], param_dtype, p.requires_grad, mx_scales)
        else:
            u = nn.Parameter(uview, requires_grad=p.requires_grad)
        if p._backward_hooks:
            # Gradient hooks registered before fully_shard (PEFT's CPT mask): the unsharded
            # parameter is the one autograd reaches. The same dict, so the caller's handles
            # still remove them.
            u._backward_hooks = p._backward_hooks
        # Keep user/Megatron attributes (e.g. tensor-parallel markers) on both.
        for k, v in user_attributes(p).items():
            setattr(s, k, v)
            setattr(u, k, v)
        sharded.append(s)
        unsharded.append(u)
    if tp is None:
        unit.bind_params(sharded, unsharded)
    else:
        unit.bind_params(sharded, unsharded, [u if i not in tp.specs else local
                                              for i, (u, local) in enumerate(zip(unsharded, locals_))])
    # Debug mode (like TORCH_DISTRIBUTED_DEBUG): ranks compare (unit, phase, size)
    # before every collective; see Unit::set_check_collectives.
    unit.check_collectives = os.environ.get("MFSDP_CHECK_COLLECTIVES", "0") == "1"
    unit.check_nonfinite = check_for_nan_in_grad
    return unit
