"""model.to_empty(device=...) then in-place initialization, FSDP2's way in from the meta
device (torchtitan's Trainer: build on meta, parallelize, `to_empty`, `init_weights()`).

After `to_empty` a unit's parameters hold uninitialized memory, as on a plain module, and
count as materialized. From then (and from `fully_shard` itself, for a unit that holds its
values: `model.apply(init_fn)` after sharding) until training starts (any root's first
forward or any optimizer step), writes into the sharded parameters are watched: a random
fill (`nn.init.normal_` / `trunc_normal_` / `uniform_` / `kaiming_*` / `xavier_*`,
`Tensor.normal_`, `uniform_`, ..., on the parameter or its `.data`; trunc_normal_'s
rejection loop too) runs on a full tensor of the parameter's shape, drawing exactly what
one plain process draws for it, and this rank keeps its slice (a fill of a detached
copy, `p.detach()` or `p.data.clone()`, is the piece's own draw). So the values equal a
plain module's given the same seed (FSDP2's DTensors draw by offset on CUDA only), every
rank's RNG stays in step, and no two pieces repeat one stream. Elementwise writes (`zero_`, `fill_`, `mul_`, `erfinv_`,
`clamp_`) act on the piece as they are; a `copy_` of a value of the parameter's shape
keeps this rank's slice of it (torchtitan's fused-qkv init builds its value whole); the
structural initializers (`nn.init.orthogonal_`, `sparse_`, `eye_`, `dirac_`, looked up on
`torch.nn.init` at call time) run on the whole parameter too. At most one parameter is
whole at a time.

Watching puts a Python call on every op of every sharded parameter
(`ShardedParameter.__torch_function__`, otherwise disabled), so it ends for every unit at
the first forward (or unshard()) of any root, or at any optimizer step; after that a
re-initialization draws each rank's piece from its own stream.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import piece_rows, sharded_param
from .dtensor_face import is_dtensor, local_shape
from .hook_support import run_outside_dynamo
from .param_index import owner_of
from .sharded_param import ShardedParameter
from .state_dict import face_shape
from .states import ParamInit

# Tensor methods and nn.init functions that fill a tensor with random values.
_TENSOR_RANDOM_FILLS = ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
                        "log_normal_", "cauchy_")
_RANDOM_FILLS = {getattr(torch.Tensor, name) for name in _TENSOR_RANDOM_FILLS} | {
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
}

# nn.init.trunc_normal_ draws by rejection, redrawing the elements out of bounds: on a
# piece those would be this rank's (its RNG no longer in step with the others'). Its body,
# looked up at each call (also through functools.partial(nn.init.trunc_normal_) made
# before), runs on the whole parameter while units are watched.
_TRUNC_NORMAL = getattr(nn.init, "_no_grad_trunc_normal_", None)

# nn.init's structural initializers, which write a whole matrix (or draw one: orthogonal_'s
# QR, sparse_'s columns) and so refuse a piece (dtensor_face.LogicalShape.ndimension): while
# units are watched they are looked up here instead, and run on the whole parameter.
_STRUCTURAL = {name: getattr(nn.init, name) for name in ("orthogonal_", "sparse_", "eye_", "dirac_")
               if callable(getattr(nn.init, name, None))}

_watched: "weakref.WeakSet" = weakref.WeakSet()
_step_hook_registered = False


def begin(states, uninitialized: bool) -> None:
    """Watch `states` until the next forward or optimizer step: random fills of their
    parameters draw whole parameters. `uninitialized` (to_empty): the parameters hold
    uninitialized memory and count as materialized from now on; otherwise (fully_shard)
    only units that hold their values are watched (a unit built on meta waits for
    materialize())."""
    for state in states:
        if not _watchable(state):
            continue
        if uninitialized:
            state.mark_loaded()
        elif state.param_init is not ParamInit.MATERIALIZED:
            continue
        _watched.add(state)
    _watch_on()


def _watchable(state) -> bool:
    # Not a unit used already: no first forward is left to end the watch.
    return state.unit is not None and state.ctx is None


def _emptied(state, index: int) -> bool:
    """to_empty() on a module inside a unit reached parameter `index` (sharded_param's data
    setter): as on a plain module, it now holds uninitialized memory and counts as written;
    a unit built on meta holds its values once every parameter was emptied or loaded
    (torchtune's LoRA: the adapters emptied and initialized, the base weights loaded with
    assign=True). Until training starts, random fills of the unit's parameters draw whole
    parameters, as after to_empty() on the unit. False (not taken: the piece is replaced
    as any assignment replaces it) for a unit used already."""
    if not _watchable(state):
        return False
    state.note_loaded([index])
    _watched.add(state)
    _watch_on()
    return True


sharded_param.emptied_in_unit = _emptied


def _watch_on() -> None:
    if _watched:
        ShardedParameter.__torch_function__ = classmethod(_torch_function)
        if _TRUNC_NORMAL is not None:
            nn.init._no_grad_trunc_normal_ = _trunc_normal
        for name, fill in _STRUCTURAL_WATCHED.items():
            setattr(nn.init, name, fill)
        global _step_hook_registered
        if not _step_hook_registered:  # kept: torch iterates its hooks while a step runs them
            register_optimizer_step_pre_hook(run_outside_dynamo(lambda optimizer, args, kwargs: end()))
            _step_hook_registered = True


def end() -> None:
    """Training started (a root's first forward, or an optimizer step): no unit is watched
    any more, so no op on a sharded parameter pays for the watch. Ending them all, not
    only the root's units, leaves no watch on for a model that is never run."""
    _watched.clear()
    if ShardedParameter.__torch_function__ is not torch._C._disabled_torch_function_impl:
        ShardedParameter.__torch_function__ = torch._C._disabled_torch_function_impl
        if _TRUNC_NORMAL is not None:
            nn.init._no_grad_trunc_normal_ = _TRUNC_NORMAL
        for name, original in _STRUCTURAL.items():
            setattr(nn.init, name, original)


def _on_whole_parameters(original):
    """`original` (an nn.init function of the tensor first) run on the whole parameter
    for a watched sharded parameter, as itself otherwise."""
    @functools.wraps(original)
    def fill(tensor, *args, **kwargs):
        if isinstance(tensor, ShardedParameter):
            state, index = owner_of(tensor)
            if state is not None and state in _watched:
                return _fill_whole(original, state, index, tensor, (tensor, *args), kwargs)
        return original(tensor, *args, **kwargs)
    return fill


_trunc_normal = _on_whole_parameters(_TRUNC_NORMAL) if _TRUNC_NORMAL is not None else None
_STRUCTURAL_WATCHED = {name: _on_whole_parameters(original) for name, original in _STRUCTURAL.items()}


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    target = args[0] if args else kwargs.get("tensor")
    if isinstance(target, ShardedParameter) and (func in _RANDOM_FILLS or func is torch.Tensor.copy_):
        state, index = owner_of(target)
        if state is not None and state in _watched:
            if func is not torch.Tensor.copy_:
                return _fill_whole(func, state, index, target, args, kwargs)
            source = args[1] if len(args) > 1 else kwargs["src"]
            # Decided by what every rank shares (the source's shape and kind), never by this
            # rank's piece: a rank holding a small parameter whole takes this path too.
            if isinstance(source, torch.Tensor) and tuple(source.shape) == tuple(face_shape(state, index)) \
                    and (is_dtensor(source) or local_shape(source) != local_shape(target)):
                # A whole value built for the parameter (torchtitan's fused-qkv init copies one
                # in; FSDP2's DTensor scatters it): this rank's slice of it, of its TP shard
                # under tensor parallelism.
                tp = state.tp
                if tp is not None and index in tp.specs:
                    source = tp.local_value(index, source)
                elif is_dtensor(source):
                    source = source.full_tensor()
                return _keep_slice(state, index, target, source)
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _data_fill(name: str):
    """PieceData's random fill `name` (`p.data.normal_()`, `nn.init.normal_(p.data)`, as
    older Hugging Face `_init_weights` write): on the parameter's `.data` while its unit is
    watched, the fill of the parameter itself (a whole draw, this rank's slice); otherwise,
    or on a copy of `.data` (clone()), the piece's own draw."""
    plain = getattr(torch.Tensor, name)

    def fill(self, *args, **kwargs):
        param = self.__dict__.get("_mfsdp_param")
        if param is not None and _watched:
            state, index = owner_of(param)
            if state is not None and state in _watched and _is_data_of(self, param):
                _fill_whole(plain, state, index, param, (param, *args), kwargs)
                return self
        return plain(self, *args, **kwargs)

    fill.__name__ = fill.__qualname__ = name
    return fill


def _is_data_of(data: torch.Tensor, param: torch.Tensor) -> bool:
    # `.data` itself is the piece's storage; a clone() of it keeps the parameter's mark
    # but not its memory. (Pieces of no elements on some ranks: equal too, and those
    # ranks draw the whole parameter as the others do, keeping the RNGs in step.)
    with DisableTorchFunctionSubclass():
        return torch.Tensor.data_ptr(data) == torch.Tensor.data_ptr(param) and \
            torch.Tensor.numel(data) == torch._C.TensorBase.numel(param)


for _name in _TENSOR_RANDOM_FILLS:
    setattr(piece_rows.PieceData, _name, _data_fill(_name))


def _fill_whole(func, state, index: int, param: torch.Tensor, args, kwargs):
    """`func` on a full tensor of the parameter's shape; this rank keeps its slice. Under
    tensor parallelism the full tensor is this rank's TP shard, filled as the DTensor TP
    alone gives (its global shape for fan-in, DTensor's random streams), as materialize does."""
    tp = state.tp
    tp_param = tp is not None and index in tp.specs
    # A TP shard is filled on its mesh's device (DTensor.from_local would copy a host
    # tensor there, and the fill would miss `whole`): an offloaded unit's piece is host memory.
    device = param.device
    if tp_param and device.type != tp.tp_mesh.device_type:
        device = torch.device(tp.tp_mesh.device_type)  # an offloaded piece: the mesh's (current) device
    whole = torch.empty(state.unit.param_spec(index).shape, dtype=param.dtype, device=device)
    filled = tp.full_of_local(index, whole) if tp_param else whole
    if args:
        args = (filled,) + tuple(args[1:])
    else:
        kwargs = {**kwargs, "tensor": filled}
    with DisableTorchFunctionSubclass():
        func(*args, **kwargs)
    return _keep_slice(state, index, param, whole)


def _keep_slice(state, index: int, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's slice of `whole` (the parameter's shape) into the parameter's piece."""
    with DisableTorchFunctionSubclass(), torch.no_grad():
        param.copy_(state.unit.local_piece(index, whole))
    return param
