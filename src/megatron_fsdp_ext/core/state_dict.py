"""torch's state-dict protocol for sharded modules and their optimizers.

`model.state_dict()` gives every sharded parameter as a DTensor of its full shape,
sharded on dim 0 over the unit's process group exactly as FSDP2 shards it; the optimizer's
`state_dict()` does the same for state shaped like a parameter (Adam's moments,
momentum). torch.distributed.checkpoint, its state-dict helpers
(get/set_model_state_dict, get/set_optimizer_state_dict, full_state_dict, cpu_offload,
broadcast_from_rank0) and FSDP2 checkpoints therefore work unchanged, at any world size.
`load_state_dict()` takes DTensors (any placement) or full tensors, and refuses a tensor
of any other shape, so nothing loads into the wrong elements.

Our shards are flat ranges of a unit's buffer, which no DTensor placement describes, so
both directions move data: state_dict() is a collective over each unit's group (every
rank calls it, as with FSDP1's state dicts). Each unit's pieces and FSDP2's rows are
exchanged by one all-to-all in which every element moves once (Unit.to_row_chunks /
piece_from_rows), so a rank receives 1/world of a unit, not all of it; where that cannot
be (a backend without all-to-all, a 0-dim parameter, a DTensor placed otherwise) the unit
is gathered whole and cut. The parameters the optimizer updates stay plain 1-D tensors.
`local_state_dict()` turns the conversion off and gives this rank's 1-D shards as they are
(no collective).

The values are copies where a plain module's and FSDP2's are the parameters' storage, so
what is written into them in place (DCP loading into `model.state_dict()`, an EMA through
its state dict) is taken at the unit's next use of its shards (apply_state_dict_writes).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import _C
from . import arrival, backends
from .agree import digest_differs
from .handed_out import HandedOutValue
from .dtensor_face import FlatShard, LogicalShape, is_dtensor, local_numel, local_shape
from .param_index import by_unit, check_materialized, check_resharded, owner_of, reshard_for_state_dict
from .states import ParamInit

_mode = threading.local()


@contextlib.contextmanager
def local_state_dict():
    """Inside this context, state_dict() of sharded modules and their optimizers returns
    each rank's 1-D shards (no collective, not loadable at another layout), and
    load_state_dict() takes them back; it also takes full values and DTensors, cut to
    this rank's piece as outside the context."""
    depth = getattr(_mode, "local", 0)
    _mode.local = depth + 1
    try:
        yield
    finally:
        _mode.local = depth


def _local_mode() -> bool:
    return getattr(_mode, "local", 0) > 0


def callers_arrived(states, what: str, call=None) -> None:
    """Before the first collective of a state-dict call: every rank of each unit's group
    has made the same call (arrival.py), so a call on some ranks only fails naming them
    instead of waiting in (or mispairing) a collective. `call`: an object of the outermost
    call that reaches every module it visits (state_dict()'s destination, a load's error
    list), so that each group is checked once per call; None: a call of its own."""
    if _local_mode():
        return
    checked = _checked_groups(call)
    for state in states:
        group = state.process_group
        if state.unit is None or id(group) in checked:
            continue
        checked.add(id(group))
        arrival.await_group(group, what, arrival.group_timeout(group, state.collective_timeout))


def _checked_groups(call) -> set:
    """The groups checked so far in `call`, kept by the thread for the latest call only
    (weakly where the object allows: a destination dict holds the whole state dict)."""
    if call is None:
        return set()
    latest = getattr(_mode, "arrival_call", None)
    if latest is not None and latest[0]() is call:
        return latest[1]
    try:
        ref = weakref.ref(call)
    except TypeError:  # a list: small, held until the next call
        ref = lambda: call  # noqa: E731
    _mode.arrival_call = (ref, set())
    return _mode.arrival_call[1]


@contextlib.contextmanager
def unread_values():
    """Inside this context, state_dict() of sharded modules and their optimizers gives
    each sharded value in its usual layout (FSDP2's DTensors) but uninitialized, without
    the collective that fills it: targets for a load to read into, whose values would be
    thrown away. Yields {id(value): (value, unit state, parameter index)} of every value
    so made, so that the load can tell them (and where each belongs) from values a
    module's own hooks replaced."""
    made: Dict[int, tuple] = {}
    previous = getattr(_mode, "unread", None)
    _mode.unread = made
    try:
        yield made
    finally:
        _mode.unread = previous


# ---------------------------------------------------------------- gathering and slicing

def _mesh(state, device_type: str) -> DeviceMesh:
    """The data-parallel mesh of the unit's DTensors (kept on the state, made once): the
    1-D mesh it was sharded on (else one over its group), or HSDP's 2-D (replicate, shard)
    mesh."""
    cached = state.__dict__.get("_dtensor_mesh")
    if cached is None or cached.device_type != device_type:
        hsdp, given = state.device_mesh, state.shard_mesh
        if hsdp is None and given is not None and given.device_type == device_type:
            cached = given  # the user's mesh: its dim names, as FSDP2's DTensors carry
        elif hsdp is None:
            cached = DeviceMesh.from_group(state.process_group, device_type)
        elif hsdp.device_type == device_type:
            cached = hsdp
        else:  # offloaded copies: the same ranks on the CPU
            cached = DeviceMesh.from_group([hsdp.get_group(0), hsdp.get_group(1)], device_type,
                                           mesh=hsdp.mesh, mesh_dim_names=hsdp.mesh_dim_names or ("replicate", "shard"))
        state.__dict__["_dtensor_mesh"] = cached
    return cached


def _mesh_device_type(state, local: torch.Tensor) -> str:
    """The device type of the mesh a value's DTensor lives on: its own where the unit's
    backend communicates it (Gloo: host copies stay on a CPU mesh), else the unit's device
    (NCCL: an offloaded unit's host shards on its CUDA mesh, as FSDP2's offload places
    them; a CPU mesh over an NCCL group could not gather them)."""
    if local.device.type in backends.device_types(state.process_group):
        return local.device.type
    return torch.device(state.unit.device).type


def _replicated(state) -> bool:
    return state.unit.strategy.replicated


def tp_spec_of(state, index: int):
    """Parameter `index`'s tensor-parallel spec in its unit, or None (not TP-sharded)."""
    tp = state.tp
    return tp.specs.get(index) if tp is not None else None


def _layout(state, index: int, device_type: str) -> Tuple[DeviceMesh, tuple, torch.Size, int]:
    """(mesh, placements, full shape, the mesh dim of the data-parallel shard) of parameter
    `index`'s state-dict DTensors, FSDP2's:
    its state_dict_dim chunked over the shard group (torch.chunk sizes), replicated over
    HSDP's replicate dim (every dp dim under no_shard); a tensor-parallel parameter on the
    (dp..., tp) mesh, its TP placements after, the dp shard strided by TP's shards of the
    same dim (tensor_parallel.py)."""
    spec = state.unit.param_spec(index)
    tp_spec = tp_spec_of(state, index)
    if tp_spec is None:
        mesh = _mesh(state, device_type)
        dp_ndim = mesh.ndim
    else:
        mesh = state.tp.spmd_mesh
        dp_ndim = state.tp.dp_ndim
    dp = [Replicate()] * dp_ndim
    if not _replicated(state) and len(spec.shape) > 0:
        dp[-1] = Shard(spec.state_dict_dim)
    if tp_spec is None:
        return mesh, tuple(dp), torch.Size(spec.shape), dp_ndim - 1
    return mesh, state.tp.placements(index, dp), tp_spec.shape, dp_ndim - 1


def face_shape(state, index: int) -> torch.Size:
    """The shape sharded parameter `index` and its gradient report (dtensor_face.LogicalShape):
    its state-dict DTensors' (FSDP2's), the full parameter's, across tensor and expert
    parallelism too."""
    tp_spec = tp_spec_of(state, index)
    return torch.Size(state.unit.param_spec(index).shape) if tp_spec is None else torch.Size(tp_spec.shape)


def face_layout(state, index: int) -> Tuple[DeviceMesh, tuple]:
    """(mesh, placements) that sharded parameter `index` and its gradient present as
    DTensors (dtensor_face.py): its state-dict DTensors' (FSDP2's), the data-parallel
    shard's Shard(dim) given as FlatShard(dim)."""
    shard = state.unit.sharded_param(index)
    mesh, placements, _, shard_dim = _layout(state, index, _mesh_device_type(state, shard))
    placements = list(placements)
    if type(placements[shard_dim]) is Shard:
        placements[shard_dim] = FlatShard(placements[shard_dim].dim)
    return mesh, tuple(placements)


def _full_of(value, what: str) -> torch.Tensor:
    return gather_dtensor(value, what) if is_dtensor(value) else value


def full_param(state, index: int) -> torch.Tensor:
    """Parameter `index`'s full value (across tensor parallelism too, as FSDP2's
    full_tensor()) on the shard's device. A collective over the unit's group (and the TP
    group). Writes into state-dict values not yet taken (a dcp.load in place into
    `model.state_dict()`) are taken first, as full_state_dict() takes them: the read is a
    collective already, and one of the parameter must see what a load wrote."""
    check_materialized([state], "full_tensor()")
    check_resharded(state, "full_tensor()")
    apply_state_dict_writes_of([state], "full_tensor()", may_change=lambda s: False)
    shard = state.unit.sharded_param(index)
    value = _row_values(state, [], shard.dtype, shard.device)[index]
    return _full_of(value, f"full_tensor() of '{state.names[index]}'")


def full_of_piece(state, index: int, piece: torch.Tensor) -> torch.Tensor:
    """The full value of `piece`, laid out like parameter `index`'s piece (a cast of it,
    `p.float()`), in its dtype. A collective over the unit's group, as full_param."""
    check_materialized([state], "full_tensor()")
    return _full_of_pieces(state, index, lambda i, p: piece if i == index else None, piece,
                           f"the full value of a cast of '{state.names[index]}'")


def full_grad(state, index: int) -> torch.Tensor:
    """The full gradient of parameter `index` from its reduced pieces (zeros where a
    parameter of the unit has none), as full_param. A collective over the unit's group."""
    # One flat gradient buffer holds every piece of the unit: one dtype.
    return _full_of_pieces(state, index, lambda i, p: p.grad, state.unit.sharded_params[index].grad,
                           f"full_tensor() of the gradient of '{state.names[index]}'")


def _full_of_pieces(state, index: int, piece_of, like: torch.Tensor, what: str) -> torch.Tensor:
    """Parameter `index`'s full value of per-parameter pieces laid out like the shards
    (`piece_of(i, param)`, zeros where it gives None), in `like`'s dtype and device."""
    pieces = []
    for i, p in enumerate(state.unit.sharded_params):
        piece = piece_of(i, p)
        pieces.append(piece if piece is not None else
                      torch.zeros(local_shape(p), dtype=like.dtype, device=like.device))
    with torch.no_grad():
        value = _row_values(state, pieces, like.dtype, like.device)[index]
    return _full_of(value, what)


def _dtensor_of(local: torch.Tensor, mesh: DeviceMesh, placements, shape=None) -> DTensor:
    """A DTensor over `local` where it lives. DTensor.from_local moves a local tensor to
    the mesh's device: an offloaded unit's host rows on its CUDA mesh would be copied to
    the GPU, where FSDP2 keeps them on the host (it builds the DTensor the same way).
    Built from its spec also where from_local would not move it: from_local's autograd
    function costs about 100x more (ms per value: state dicts make one per parameter
    and per optimizer state)."""
    shape = local.shape if shape is None else torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _rows_as_dtensor(state, index: int, rows: torch.Tensor) -> DTensor:
    """This rank's torch.chunk rows of a parameter-shaped value, as FSDP2 stores it."""
    mesh, placements, shape, _ = _layout(state, index, _mesh_device_type(state, rows))
    return _dtensor_of(rows, mesh, placements, shape)


def _row_values(state, pieces: list, dtype: torch.dtype, device: torch.device) -> list:
    """Every parameter's value (`pieces`: per-parameter state laid out like the shards;
    [] for the parameters themselves) as state dicts give it, on `device`: FSDP2's
    DTensors, or full tensors for replicated strategies (DTensors on the TP mesh for
    tensor-parallel parameters). One collective over the unit's group."""
    unit = state.unit
    made = getattr(_mode, "unread", None)
    if made is not None:  # a load's targets: the layout without the values
        values = _layout_values(state, dtype, device)
        for i, value in enumerate(values):
            made[id(value)] = (value, state, i)
        return values
    if not _replicated(state) and unit.exchanges_rows:
        rows = unit.to_row_chunks(pieces, dtype)
        return [_rows_as_dtensor(state, i, r.to(device)) for i, r in enumerate(rows)]
    full = unit.gather_full_params() if not pieces else unit.gather_full(pieces, dtype)
    full = [f.to(device=device, dtype=dtype) for f in full]
    return [_as_dtensor(state, i, f) for i, f in enumerate(full)]


def _layout_values(state, dtype: torch.dtype, device) -> list:
    """Every parameter's value as _row_values gives it, uninitialized: the layout (mesh,
    placements, shape) without the values. No collective."""
    return [_as_dtensor(state, i, torch.empty((), dtype=dtype, device=device).expand(state.unit.param_spec(i).shape),
                        values=False)
            for i in range(len(state.names))]


def _exchangeable(state, value: DTensor, index: int) -> bool:
    """Whether `value` is placed as our state dicts place parameter `index` (same ranks,
    FSDP2's placements, this rank's torch.chunk rows), so its rows can come back by the
    exchange instead of a gather."""
    unit = state.unit
    if _replicated(state) or not unit.exchanges_rows:
        return False
    mesh = value.device_mesh
    ours, placements, _, shard_dim = _layout(state, index, mesh.device_type)
    if mesh.ndim != ours.ndim or tuple(value.placements) != tuple(placements):
        return False
    for dim in range(mesh.ndim):
        if dist.get_process_group_ranks(mesh.get_group(dim)) != dist.get_process_group_ranks(ours.get_group(dim)):
            return False
    shape = unit.param_spec(index).shape  # the local (TP) shape the unit holds
    begin, end = _C.chunk_rows(shape[0], ours.size(shard_dim), ours.get_local_rank(shard_dim))
    return tuple(value.to_local().shape) == (end - begin, *shape[1:])


def _piece_of(state, index: int, value, local_numel: int, what: str) -> torch.Tensor:
    """This rank's 1-D piece of parameter `index` from a loaded value: FSDP2-placed
    DTensors by the exchange, anything else gathered (a collective) and cut (its TP shard,
    then this rank's piece)."""
    full_shape = tuple(face_shape(state, index))
    if is_dtensor(value) and tuple(value.shape) == full_shape and _exchangeable(state, value, index):
        local = value.to_local()
        if local.device.type != value.device_mesh.device_type:  # offloaded copies: exchange where the mesh lives
            local = local.to(value.device_mesh.device_type)
        return state.unit.piece_from_rows(index, local.contiguous())
    full = _full_value(value, full_shape, local_numel, what)
    if tp_spec_of(state, index) is not None:
        full = state.tp.local_of_full(index, full)
    return state.unit.local_piece(index, full)


def _as_dtensor(state, index: int, full: torch.Tensor, values: bool = True):
    """`full` (parameter `index`'s value as the unit holds it: the local TP shard) as
    FSDP2 stores it (see _layout); replicated strategies give plain full tensors, or a
    tensor-parallel parameter's DTensor replicated over the dp dims. values=False: the
    same layout, uninitialized (`full` may then be an expanded scalar, holding no memory)."""
    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if values else torch.empty(t.shape, dtype=t.dtype, device=t.device)

    if _replicated(state) and tp_spec_of(state, index) is None:
        return full if values else own(full)
    mesh, placements, shape, shard_dim = _layout(state, index, _mesh_device_type(state, full))
    if full.dim() == 0:
        return _dtensor_of(own(full), mesh, placements)
    dim = state.unit.param_spec(index).state_dict_dim
    local = full
    if not _replicated(state):
        begin, end = _C.chunk_rows(full.shape[dim], mesh.size(shard_dim), mesh.get_local_rank(shard_dim))
        local = full.narrow(dim, begin, end - begin)
    return _dtensor_of(own(local), mesh, placements, shape)


def gather_dtensor(value: DTensor, what: str = "gather_dtensor") -> torch.Tensor:
    """DTensor.full_tensor() through the plain c10d collectives of our Communicator: one
    uneven all-gather (all_gather_v) per sharded mesh dim (innermost first), after a small
    one of the local sizes. torch's full_tensor() goes through its functional collectives,
    which crash on some backends (Gloo with CUDA tensors, torch 2.11: SIGSEGV). Collective
    over the DTensor's mesh; other placements go through DTensor.full_tensor()."""
    mesh, local = value.device_mesh, value.to_local()
    if local.device.type != mesh.device_type:  # offloaded (cpu_offload=True): gather where the mesh lives
        local = local.to(mesh.device_type)
    if not all(type(p) in (Shard, Replicate) for p in value.placements):
        # Another placement (_StridedShard from FSDP2 over tensor parallelism, Partial):
        # torch knows its element order; our row gather would not.
        if local.device != value.to_local().device:
            value = DTensor.from_local(local, mesh, value.placements, shape=value.shape, stride=value.stride())
        return value.full_tensor()
    for mesh_dim in reversed(range(mesh.ndim)):
        placement = value.placements[mesh_dim]
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            raise ValueError(f"{what}: a DTensor placed as {placement} on mesh dim {mesh_dim} cannot be gathered; "
                             "only Shard and Replicate placements load")
        comm = _C.Communicator(mesh.get_group(mesh_dim))
        rows = local.movedim(placement.dim % local.dim(), 0)
        mine = torch.tensor([rows.shape[0]], dtype=torch.int64, device=local.device)
        sizes = torch.empty(comm.size, dtype=torch.int64, device=local.device)
        comm.all_gather_flat(sizes, mine)
        sizes = sizes.tolist()
        row_numel = math.prod(rows.shape[1:])
        numels = [n * row_numel for n in sizes]
        starts = list(itertools.accumulate(numels[:-1], initial=0))
        gathered = rows.new_empty((sum(sizes), *rows.shape[1:]))
        # The sizes came from every rank just now: the segment table is the same everywhere.
        comm.all_gather_v(gathered.view(-1), rows.contiguous().view(-1), starts, numels, verify=False)
        local = gathered.movedim(0, placement.dim % local.dim())
    if tuple(local.shape) != tuple(value.shape):
        raise ValueError(f"{what}: gathering the DTensor gave shape {tuple(local.shape)}, expected "
                         f"{tuple(value.shape)} (ranks disagree on the local sizes)")
    return local


def _full_value(value, shape: tuple, local_numel: int, what: str) -> torch.Tensor:
    """The full tensor behind a loaded value: a DTensor (gathered: a collective over its
    mesh) or a plain tensor of the full shape. Anything else is refused."""
    if is_dtensor(value):
        if tuple(value.shape) != shape:
            raise ValueError(f"{what}: the loaded DTensor has shape {tuple(value.shape)}, expected {shape}")
        return gather_dtensor(value, what)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        hint = ""
        if value.dim() == 1 and value.numel() == local_numel:
            hint = (" (it has this rank's shard size: a 1-D shard from local_state_dict() loads only "
                    "inside local_state_dict(), at the layout that wrote it)")
        raise ValueError(
            f"{what}: got a tensor of shape {tuple(value.shape)}, expected the full shape {shape} "
            f"or a DTensor as state_dict() returns{hint}")
    return value


class _LoadedPiece(LogicalShape, torch.Tensor):
    """A loaded value cut to this rank's piece, reporting its parameter's shape (as the
    parameter does) for torch's size check in Module._load_from_state_dict, which then
    copies the piece into the shard."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _logical_shape(self) -> torch.Size:
        return self.__dict__["_mfsdp_face_shape"]

    @staticmethod
    def of(piece: torch.Tensor, shape: torch.Size) -> "_LoadedPiece":
        out = piece.as_subclass(_LoadedPiece)
        out.__dict__["_mfsdp_face_shape"] = shape
        return out


def _is_the_shard(value, shard) -> bool:
    # Identity only: every rank decides alike (a storage test would differ on ranks whose
    # shard is empty, and the ranks would then disagree on the collectives that follow).
    return value is shard


# ---------------------------------------------------------------- module hooks

class ModuleStateDictHooks:
    """The state-dict hooks of one module of a fully_shard unit (a unit of several modules
    has one per module); `keys` maps each state_dict key (relative to the module) of the
    unit's parameters to the parameter's index.

    Every module's own hooks see full-shape values, as under FSDP2 (torchtitan's fused-qkv
    linear splits `wqkv` in its state-dict post-hook and merges it in its load pre-hook):
    - save: the unit's module computes every value (DTensors) with one collective in a
      state-dict pre-hook; the module that directly owns each parameter puts its values in
      a post-hook that runs first among that module's post-hooks, so its own hooks and
      every ancestor's see them; the unit module's last post-hook drops them;
    - load: the owning module cuts each value to this rank's piece in a load pre-hook kept
      last among its load pre-hooks, also behind those registered after fully_shard (they
      merge or rename the full values first): keep_load_pre_hooks_last."""

    def __init__(self, state, module, keys: List[Tuple[str, int]]):
        self.state = state
        self._values: Optional[list] = None  # this state_dict() call's values (the unit module's pre-hook)
        self._keep_vars = False  # this state_dict() call's keep_vars (every owner's pre-hook)
        by_owner: Dict[int, Tuple[nn.Module, List[Tuple[str, int]]]] = {}
        for key, i in keys:
            path, _, name = key.rpartition(".")
            owner = module.get_submodule(path) if path else module
            by_owner.setdefault(id(owner), (owner, []))[1].append((name, i))
        # Plain functions: torch tags public hooks with an attribute, which a bound method refuses.
        module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self._compute())
        for owner, owned in by_owner.values():
            owner.register_state_dict_pre_hook(lambda m, prefix, keep_vars: setattr(self, "_keep_vars", keep_vars))
            handle = owner.register_state_dict_post_hook(
                lambda m, sd, prefix, md, owned=owned: self._put_values(m, sd, prefix, owned))
            owner._state_dict_hooks.move_to_end(handle.id, last=False)
            handle = owner.register_load_state_dict_pre_hook(lambda *a, owned=owned: self._pre_load(owned, *a))
            state.own_load_pre_hooks.append((weakref.ref(owner), handle.id))
        module.register_state_dict_post_hook(lambda *a: self._drop_values())

    def _compute(self) -> None:
        state = self.state
        self._values = None
        if state.unit is None:
            return
        state.unit.wait_host_update()  # an overlapped optimizer step may still write the shard
        if _local_mode():
            return
        self._values = self._current_values()

    def _current_values(self) -> list:
        state = self.state
        if state.param_init is ParamInit.DEFERRED:
            # Built on the meta device, no values yet: FSDP2's meta DTensors (their mesh,
            # placements and shapes are what a loader such as Accelerate's builds the
            # values from, to load them with assign=True).
            return _layout_values(state, state.unit.sharded_param(0).dtype, "meta")
        apply_state_dict_writes(state, "state_dict()", keep_held=True)
        reshard_for_state_dict(state, "state_dict()")
        shard = state.unit.sharded_param(0)
        return _row_values(state, [], shard.dtype, shard.device)

    def _drop_values(self) -> None:
        self._values = None

    def _put_values(self, owner: nn.Module, state_dict, prefix: str, owned: List[Tuple[str, int]]) -> None:
        state = self.state
        if state.unit is None or _local_mode():
            return
        present = [(k, i) for k, i in owned if prefix + k in state_dict]
        if not present:
            return
        # state_dict() called on this module alone, not through the unit's module: gather
        # now, once every rank has made the call (a submodule's state_dict() on one rank, as
        # PEFT lists a saved module's keys, would otherwise wait in the gather silently).
        values = self._values
        if values is None:
            callers_arrived([state], "state_dict()", state_dict)
            values = self._current_values()
        if self._keep_vars:
            self._as_parameters(owner, present, values)
        for key, i in present:
            state_dict[prefix + key] = values[i]
            if not values[i].is_meta:
                record_handed_out(state, i, values[i])

    def _as_parameters(self, owner: nn.Module, present: List[Tuple[str, int]], values: list) -> None:
        """keep_vars=True: each value, replaced in `values` (this call's own list), as an
        nn.Parameter with its parameter's requires_grad, as torch and FSDP2 hand out the
        parameters themselves (code keeps the trainable entries by `v.requires_grad`).
        Still copies: they are not the parameter objects, whose local tensors are our flat
        pieces. One object per parameter, so tied keys share it as they share the parameter."""
        for key, i in present:
            if not isinstance(values[i], nn.Parameter):
                live = owner._parameters.get(key)
                requires_grad = live.requires_grad if live is not None else False
                values[i] = nn.Parameter(values[i], requires_grad=requires_grad)

    def _pre_load(self, owned: List[Tuple[str, int]], module, state_dict, prefix, local_metadata, strict,
                  missing_keys, unexpected_keys, error_msgs) -> None:
        state = self.state
        if state.unit is None:
            return
        state.unit.wait_host_update()
        if _local_mode():
            # Pieces load as they are; full values and DTensors are cut as outside the
            # context. A value shaped like both the piece and the parameter (a rank holding
            # a whole 1-D parameter) is the same elements either way, so every rank loads
            # the same parameter; torch compares anything else's shape with the parameter's.
            for key, i in owned:
                value = state_dict.get(prefix + key)
                shard = state.unit.sharded_param(i)
                if not isinstance(value, torch.Tensor) or value is shard:
                    continue
                shape = face_shape(state, i)
                if not is_dtensor(value) and local_shape(value) == local_shape(shard):
                    state_dict[prefix + key] = _LoadedPiece.of(value, shape)
                elif is_dtensor(value) or tuple(value.shape) == tuple(shape):
                    piece = _piece_of(state, i, value, local_numel(shard), f"load_state_dict '{prefix + key}'")
                    state_dict[prefix + key] = _LoadedPiece.of(piece, shape)
            state.note_loaded(i for key, i in owned if isinstance(state_dict.get(prefix + key), _LoadedPiece))
            return
        callers_arrived(state.with_companions, "load_state_dict()", error_msgs)
        _agree_on_keys_loaded(state, owned, state_dict, prefix)
        apply_state_dict_writes(state, "load_state_dict()")  # earlier writes, then the load over them
        assign = local_metadata.get("assign_to_params_buffers", False)
        if assign:
            _check_assignable(state, owned, state_dict, prefix)
        reshard_for_state_dict(state, "load_state_dict()")
        written = []
        for key, i in owned:
            if prefix + key not in state_dict:
                continue  # strict loading reports it
            shard, value = state.unit.sharded_param(i), state_dict[prefix + key]
            if _is_the_shard(value, shard):
                continue  # the parameter itself (torch's helpers fill keys they were not given so)
            piece = _piece_of(state, i, value, local_numel(shard), f"load_state_dict '{prefix + key}'")
            if assign:
                # assign=True (Accelerate's load into a model sharded on meta): the unit owns
                # the parameter objects, so the values are written into them, and torch then
                # assigns the parameter itself back: the values are the state dict's and
                # requires_grad the parameter's, as assign gives a plain module.
                with torch.no_grad():
                    shard.copy_(piece)
                state_dict[prefix + key] = shard
            else:
                # torch compares the value's shape with the parameter's (its full shape).
                state_dict[prefix + key] = _LoadedPiece.of(piece, face_shape(state, i))
            written.append(i)
        state.note_loaded(written)


def _agree_on_keys_loaded(state, owned: List[Tuple[str, int]], state_dict, prefix: str) -> None:
    """A load cuts each value into every rank's piece, and some values need a collective
    to be cut (a DTensor of other placements): every rank must load the same parameters
    of the unit. A key passed on some ranks only (Accelerate's FULL_STATE_DICT load of
    PEFT adapters gives rank 0 the file and the others an empty dict) left the ranks in
    different collectives, waiting forever. One small all-reduce per unit a load
    reaches; a difference raises on every rank, naming the first key."""
    if not owned:
        return
    present = torch.tensor([int(prefix + key in state_dict) for key, _ in owned], dtype=torch.int32)
    agreed = _agree_max(state, torch.cat([present, 1 - present]))
    differs = [k for (k, _), some, others in zip(owned, agreed[:len(owned)], agreed[len(owned):]) if some and others]
    if differs:
        more = f" (and {len(differs) - 1} more of the unit's keys)" if len(differs) > 1 else ""
        raise ValueError(
            f"load_state_dict into {state}: '{prefix + differs[0]}'{more} was passed on some ranks and not on "
            "others. Loading a fully_shard model is collective: "
            "pass the same keys on every rank (for rank 0's values alone, torch's set_model_state_dict(model, "
            "values, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)) or "
            "megatron_fsdp_ext.load_full_state_dict(model, values, broadcast_from_rank0=True))")


def _check_assignable(state, owned: List[Tuple[str, int]], state_dict, prefix: str) -> None:
    """load_state_dict(assign=True) gives a plain module the values' dtype and device; a
    unit's shards keep theirs, so a value that would change them (or a meta value, which
    holds none) is refused before anything is written."""
    for key, i in owned:
        value = state_dict.get(prefix + key)
        shard = state.unit.sharded_param(i)
        if not isinstance(value, torch.Tensor) or _is_the_shard(value, shard):
            continue
        why = None
        if value.is_meta:
            why = "a meta value holds no values to load"
        elif value.dtype != shard.dtype:
            why = f"it is {value.dtype} and the parameter {shard.dtype}"
        elif value.device.type != shard.device.type and not is_dtensor(value):
            why = f"it is on {value.device} and the parameter on {shard.device}"
        if why is not None:
            raise RuntimeError(
                f"load_state_dict(assign=True) of '{prefix + key}' into {state}: {why}. assign=True would make "
                "the parameter the value itself, and a unit's parameters keep their flat buffer's dtype and "
                "device; cast or move the value to the parameter's, or load without assign=True")


# ---------------------------------------------------------------- writes into handed-out values

def record_handed_out(state, index: int, value: torch.Tensor) -> None:
    """state_dict() handed `value` out for parameter `index`: a copy (our shards are not
    FSDP2's rows), where on a plain module and under FSDP2 a state-dict value is the
    parameter's storage and code writes through it in place (torch.distributed.checkpoint
    loading into `model.state_dict()` with no load_state_dict() after; an EMA lerping into
    `ema.state_dict().values()`). Watched until the unit's next use
    (apply_state_dict_writes), weakly, or by its storage once dropped (HandedOutValue: a
    dict written and then dropped still counts). Not a load's own targets (unread_values: scratch space its
    reader verifies before anything loads), and once per value (a tied parameter gives
    the same value under two keys)."""
    if _handing_out(value, [(i, watch) for i, watch in state.handed_out if i == index]):
        state.handed_out.append((index, HandedOutValue(value)))


def _handing_out(value, same_index) -> bool:
    """Whether `value` is a state-dict value to watch: not under unread_values(), and not
    already watched among `same_index` ((index, HandedOutValue) of the same piece)."""
    return getattr(_mode, "unread", None) is None and not any(watch.is_of(value) for _, watch in same_index)


def _agreement_groups(state) -> Tuple[tuple, list, torch.device]:
    """(key, process groups, device) of the unit's agreement: every dim of each distinct
    mesh its state-dict DTensors span, in parameter order (the same on every rank); the
    key names them by their ranks, so units over the same ranks agree in one collective."""
    shard = state.unit.sharded_param(0)
    device_type = _mesh_device_type(state, shard)
    device = torch.device(state.unit.device) if device_type != "cpu" else torch.device("cpu")
    keys, groups = [], []
    for i in range(len(state.names)):
        mesh = _layout(state, i, device_type)[0]
        for dim in range(mesh.ndim):
            key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), dim)
            if key not in keys:
                keys.append(key)
                groups.append(mesh.get_group(dim))
    return (tuple(keys), str(device)), groups, device


def _agree_max(state, flags: torch.Tensor) -> torch.Tensor:
    """Element-wise max of `flags` over every rank the unit's state-dict DTensors span."""
    _, groups, device = _agreement_groups(state)
    out = flags.to(device)
    for group in groups:
        if dist.get_world_size(group) > 1 and backends.moves_data(group, device):
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.cpu()


def _held_flags(watches: list) -> torch.Tensor:
    """[written..., gone..., kept by the caller...] of handed-out values, this rank's view:
    written where the value changed since it was handed out, held by the caller or
    dropped after (HandedOutValue), gone where no value is left to read, kept where the
    caller still holds it (only those can be written again: they stay watched after a use
    that keeps watching)."""
    return torch.tensor(HandedOutValue.counts_as_written(watches) + [not w.has_value() for w in watches] +
                        [w.caller_holds() for w in watches], dtype=torch.int32)


def apply_state_dict_writes_of(states, where: str, may_change: Optional[Callable[[object], bool]] = None) -> None:
    """apply_state_dict_writes before a use of `states`' shards (the root's pre-forward:
    every unit before any gather; a unit's gathers, pre-backward, unshard(), an optimizer
    step, full_state_dict()): units whose agreement spans the same ranks share one
    all-reduce of their held/dropped flags, so a job taking state_dict() every step pays
    one small collective at the next forward, not one per unit. Nothing when no value is
    watched.

    `may_change(state)`: whether, as this rank sees it, the use may change the unit's
    parameters (default: it may). A use no rank thinks may change them leaves the values
    still held in step with the parameters, so they stay watched (keep_held): torch's
    get_optimizer_state_dict takes an optimizer step at lr 0 on zero gradients to create
    the state, between the model's state_dict() and a load into its values."""
    pending = [s for s in states if s.handed_out and s.unit is not None]
    if not pending or _local_mode():
        return
    by_key: Dict[tuple, list] = {}
    for s in pending:
        by_key.setdefault(_agreement_groups(s)[0], []).append(s)
    for group in by_key.values():
        # The callers' values, held strongly until each unit is settled: a value the flags
        # counted as held must not be collected while an earlier unit of the group writes
        # back (a dropped value's alias is kept by its watch).
        alive = [[r[1].caller_value() for r in s.handed_out] for s in group]
        flags = [_held_flags([r[1] for r in s.handed_out]) for s in group]
        # One more flag per unit, agreed in the same all-reduce: may the use change it.
        changes = torch.tensor([int(may_change is None or may_change(s)) for s in group], dtype=torch.int32)
        agreed = _agree_max(group[0], torch.cat(flags + [changes]))
        offset = 0
        for k, (s, f) in enumerate(zip(group, flags)):
            keep_held = not bool(agreed[-len(group) + k])
            apply_state_dict_writes(s, where, keep_held=keep_held, agreed=agreed[offset: offset + f.numel()])
            offset += f.numel()
        del alive


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.equal(a.to(device=b.device, dtype=b.dtype), b)


def apply_state_dict_writes(state, where: str, keep_held: bool = False, agreed: Optional[torch.Tensor] = None) -> None:
    """Before the unit's next use of its shards (a forward's gathers, unshard(), an
    optimizer step, a load, the next state_dict()): what was written in place into the
    values state_dict() handed out becomes the parameters' values, as it would be on a
    plain module or under FSDP2 (_write_back). `keep_held` (the next state_dict(), which is
    not a use of the values): values some rank still holds stay watched, so writes into an
    earlier state dict made after a later state_dict() call still arrive. `agreed`: the
    held/dropped flags already agreed on (apply_state_dict_writes_of)."""
    records, state.handed_out = state.handed_out, []
    if not records or state.unit is None or _local_mode():
        return
    kept = _write_back(state, [(i, ref, None) for i, ref in records], where, "model.load_state_dict()",
                       live_of=lambda i, _: state.unit.sharded_param(i), reshard=True, agreed=agreed)
    if keep_held:  # what some rank's caller holds: the same records on every rank
        state.handed_out = [(i, w) for i, w, _ in kept] + state.handed_out


def _write_back(state, records, where: str, load_call: str, *, live_of, reshard: bool,
                agreed: Optional[torch.Tensor] = None) -> list:
    """The write-back of handed-out state-dict values of one unit. `records`: (parameter
    index, HandedOutValue, tag); `live_of(index, tag)`: the live 1-D piece the value
    is a copy of (a shard, an optimizer state). Returns the records some rank's caller
    still holds (the same on every rank).

    Values written on no rank (held or dropped: their fingerprints and version counters,
    HandedOutValue) cost one small all-reduce of flags, and a change made on the
    parameter's side since stays. The others come back to this rank's pieces as a load
    brings them (the rows' exchange; a rank that did not write its value gives the rows it
    was handed) and are compared there, element for element; a piece any rank finds
    written is written on every rank, and the values written back are in step with their
    parameters again (`resync`). Refused, on every rank, where it cannot be made right:
    two values of one piece both written, a write between a forward and its backward
    (torch's autograd refuses that of a plain parameter). Every decision is an agreed one,
    so the watch lists stay the same on every rank."""
    n = len(records)
    values = [watch() for _, watch, _ in records]
    if agreed is None:
        agreed = _agree_max(state, _held_flags([watch for _, watch, _ in records]))
    held = [r for r in range(n) if agreed[r]]  # written on some rank
    if not held:
        return [records[r] for r in range(n) if agreed[2 * n + r]]

    def names(rs):
        return sorted({state.names[records[r][0]] + ("" if records[r][2] is None else f" '{records[r][2]}'")
                       for r in rs})

    with torch.no_grad():
        state.unit.wait_host_update()
        gone = [r for r in held if agreed[n + r]]
        if gone:  # a watch keeps a dropped value's storage: none should be missing
            raise RuntimeError(
                f"megatron_fsdp_ext: {state}: state-dict values of {names(gone)} are held on some ranks and gone on "
                f"others, so their rows cannot be put back together; load the state dict with {load_call}")
        pieces, changed = {}, torch.zeros(n, dtype=torch.int32)
        for r in held:  # the rows' exchange, as a load makes it
            i, _, tag = records[r]
            live = live_of(i, tag).detach().as_subclass(torch.Tensor)
            pieces[r] = _piece_of(state, i, values[r], live.numel(), f"state-dict value of {names([r])[0]}")
            changed[r] = int(_differs(pieces[r].reshape(-1), live.reshape(-1)))
        written = [r for r, c in zip(held, _agree_max(state, changed[held]).tolist()) if c]
        for r in held:
            records[r][1].resync()
        if not written:
            return [records[r] for r in range(n) if agreed[2 * n + r]]
        keys = [(records[r][0], records[r][2]) for r in written]
        twice = [r for r in written if keys.count((records[r][0], records[r][2])) > 1]
        if twice:
            raise RuntimeError(
                f"megatron_fsdp_ext: {state}: the values of {names(twice)} in two state dicts were both written in "
                "place: under fully_shard each state-dict value is a copy, so both writes cannot apply. Write into "
                f"one, or load the one you want with {load_call}")
        ctx = state.ctx
        if ctx is not None and ctx.in_backward:
            raise RuntimeError(
                f"megatron_fsdp_ext: {state}: state-dict values of {names(written)} were written in place between "
                f"a forward and its backward ({where}); the backward would use the old values. Write them before "
                "the forward or after the backward")
        if reshard:
            reshard_for_state_dict(state, f"writing state_dict() values back ({where})")
        for r in written:  # on every rank (each its piece): every shard's version moves alike
            i, _, tag = records[r]
            live = live_of(i, tag)
            live.copy_(_LoadedPiece.of(pieces[r], face_shape(state, i)) if reshard else pieces[r].reshape(live.shape))
    return [records[r] for r in range(n) if agreed[2 * n + r]]


def keep_load_pre_hooks_last(states) -> None:
    """Move the units' load pre-hooks (ModuleStateDictHooks._pre_load) to the end of their
    owners' hooks: torch runs them in insertion order, and a hook registered after
    fully_shard must see the full values, as on a plain module. Called by the fully_shard
    module's _load_from_state_dict, before load_state_dict (top-down) reaches the owners
    (moving a hook while torch iterates the dict would raise)."""
    for state in states:
        for ref, hook_id in state.own_load_pre_hooks:
            owner = ref()
            if owner is None:
                continue
            hooks = owner._load_state_dict_pre_hooks
            if hook_id in hooks:
                hooks.move_to_end(hook_id)


# ---------------------------------------------------------------- optimizer hooks

def _units_in(optimizer, saved_groups) -> List[Tuple[object, Dict[int, object]]]:
    """Units whose shards `optimizer` updates, in the order the optimizer lists them, each
    with {parameter index in the unit: the key the state dict uses for it}."""
    return by_unit((p, key) for group, saved in zip(optimizer.param_groups, saved_groups)
                   for p, key in zip(group["params"], saved["params"]))


def _agree(state, signature: str, what: str) -> None:
    """Every rank of the unit's group must gather the same state keys, or the gathers
    below would pair different tensors."""
    if digest_differs([signature], state.process_group, state.unit.device):
        raise RuntimeError(
            f"{what}: ranks of {state} hold different optimizer state for its parameters "
            f"(this rank: {signature}); every rank must step the same parameters")


def _shard_shaped_keys(state, index_to_key, states) -> Dict[str, torch.dtype]:
    keys: Dict[str, torch.dtype] = {}
    for i, key in index_to_key.items():
        shard = state.unit.sharded_param(i)
        for name, v in states.get(key, {}).items():
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.dim() > 0:
                if tuple(v.shape) != tuple(local_shape(shard)):
                    raise NotImplementedError(
                        f"optimizer state '{name}' of '{state.names[i]}' has shape {tuple(v.shape)}, not the "
                        f"shard's {tuple(local_shape(shard))}: state shaped unlike its parameter cannot be resharded")
                keys.setdefault(name, v.dtype)
    return keys


def _optimizer_post_state_dict(optimizer, state_dict):
    if _local_mode():
        return None
    states = state_dict["state"]
    units = _units_in(optimizer, state_dict["param_groups"])
    callers_arrived([state for state, _ in units], "optimizer.state_dict()")
    apply_optimizer_state_dict_writes(optimizer, "optimizer.state_dict()", keep_held=True)
    for state, index_to_key in units:
        keys = _shard_shaped_keys(state, index_to_key, states)
        if getattr(_mode, "unread", None) is None:  # unread values need no collective to agree on
            _agree(state, ",".join(f"{k}:{d}" for k, d in sorted(keys.items(), key=lambda kv: kv[0])),
                   "optimizer.state_dict()")
        if not keys:
            continue
        reshard_for_state_dict(state, "optimizer.state_dict()")
        for key in index_to_key.values():  # our copies: the live entries stay untouched
            if key in states:
                states[key] = dict(states[key])
        for name in sorted(keys):
            pieces: List[Optional[torch.Tensor]] = [None] * len(state.names)
            for i, key in index_to_key.items():
                pieces[i] = states.get(key, {}).get(name)
            device = next(p.device for p in pieces if p is not None)
            values = _row_values(state, pieces, keys[name], device)
            for i, key in index_to_key.items():
                if key in states and name in states[key]:
                    states[key][name] = values[i]
                    watched = optimizer.__dict__.setdefault(_OPTIM_HANDED_OUT, [])
                    if _handing_out(values[i], [(j, ref) for sref, j, n, ref in watched
                                                if sref() is state and j == i and n == name]):
                        watched.append((weakref.ref(state), i, name, HandedOutValue(values[i])))
    return state_dict


# optimizer.__dict__ key: the optimizer state-dict values handed out, as
# (weakref to the unit's state, parameter index, state name, HandedOutValue).
_OPTIM_HANDED_OUT = "_mfsdp_handed_out"


def apply_optimizer_state_dict_writes(optimizer, where: str, keep_held: bool = False) -> None:
    """The optimizer's counterpart of apply_state_dict_writes: before its next step, load
    or state_dict(), what was written in place into the values optimizer.state_dict()
    handed out (Adam's moments, as FSDP2-placed DTensors: copies of our pieces) becomes
    the optimizer's state, as it would on a plain module or under FSDP2 (DCP loading in
    place into `optimizer.state_dict()`). Unit by unit, in the order they were handed out."""
    records = optimizer.__dict__.pop(_OPTIM_HANDED_OUT, None)
    if not records or _local_mode():
        return
    by_state: Dict[int, Tuple[object, list]] = {}
    for state_ref, i, name, ref in records:
        state = state_ref()
        if state is not None and state.unit is not None:
            by_state.setdefault(id(state), (state, []))[1].append((i, ref, name))
    kept = []
    for state, recs in by_state.values():
        def live_of(i, name, state=state):
            return optimizer.state[state.unit.sharded_param(i)][name]
        held = _write_back(state, recs, where, "optimizer.load_state_dict()", live_of=live_of, reshard=False)
        kept += [(weakref.ref(state), i, name, w) for i, w, name in held]
    if keep_held and kept:
        optimizer.__dict__[_OPTIM_HANDED_OUT] = kept + optimizer.__dict__.get(_OPTIM_HANDED_OUT, [])


def _optimizer_pre_load(optimizer, state_dict):
    # In local_state_dict() mode this rank's pieces load as they are; full values and
    # DTensors are cut, as for the parameters.
    keep_local = _local_mode()
    units = _units_in(optimizer, state_dict["param_groups"])
    callers_arrived([state for state, _ in units], "optimizer.load_state_dict()")
    apply_optimizer_state_dict_writes(optimizer, "optimizer.load_state_dict()")  # earlier writes, then the load
    state_dict = dict(state_dict)
    states = dict(state_dict["state"])
    for state, index_to_key in units:
        for i, key in index_to_key.items():
            if key in states:
                states[key] = _cut_entry(state, i, states[key], "optimizer.load_state_dict", keep_local=keep_local)
    state_dict["state"] = states
    return state_dict


def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Install the optimizer's state-dict hooks. Called once per optimizer, by
    shard_changes.adopt when it first finds sharded parameters in it (at its first
    step: also the step torch's get/set_optimizer_state_dict take to initialize state)."""
    optimizer.register_state_dict_post_hook(_optimizer_post_state_dict)
    optimizer.register_load_state_dict_pre_hook(_optimizer_pre_load)


def convert_loaded_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """State loaded by optimizer.load_state_dict() before our hooks were attached (a
    fresh optimizer that never stepped) holds full tensors or DTensors: cut this rank's
    pieces now, before the first step uses them."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state, i = owner_of(p)
            if state is not None and optimizer.state.get(p):
                optimizer.state[p] = _cut_entry(state, i, optimizer.state[p], "optimizer state", keep_local=True)


def _cut_entry(state, index: int, entry: dict, what: str, keep_local: bool) -> dict:
    """A copy of one parameter's optimizer state with every DTensor or full-shape tensor
    cut to this rank's piece (scalars such as Adam's step as they are). keep_local: a plain
    tensor already shaped like the shard is kept (loaded in local_state_dict() mode);
    otherwise it is refused like any other shape."""
    shard = state.unit.sharded_param(index)
    out = dict(entry)
    for name, v in entry.items():
        if not isinstance(v, torch.Tensor) or (not is_dtensor(v) and v.dim() == 0):
            continue
        if keep_local and not is_dtensor(v) and v.shape == local_shape(shard):
            continue
        piece = _piece_of(state, index, v, local_numel(shard), f"{what}: state '{name}' of '{state.names[index]}'")
        out[name] = piece.to(shard.device).clone()
    return out
