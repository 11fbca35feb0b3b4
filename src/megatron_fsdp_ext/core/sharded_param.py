"""ShardedParameter: the class of the parameters `module.parameters()` yields after
fully_shard (this rank's 1-D piece of each parameter, a view of its unit's flat shard).

It exists for one reason: `p.data` hands out a tensor whose in-place writes move no
version counter (that is what `.data` is for), so a unit that keeps a gathered, cast or
quantized copy of its shard (optim / optim_grads / no_shard, a bf16 host copy under
offload, FP8 scales) cannot see `p.data.clamp_(...)` by its versions. FSDP2 sees such
writes because it reads the sharded storage at every gather. Here, handing out `.data`
reports the shard changed (`Unit.shard_changed`, a flag: no communication, no copy), so
the next use gathers, casts and scales again from the shard. A read of `.data` that
writes nothing costs one extra gather of that unit; the hot paths (forward, backward,
torch's optimizers, clipping) never touch `.data`.

Between its unit's backward and the optimizer step it presents itself as a DTensor, as
FSDP2's parameters are (dtensor_face.py): `isinstance(p, DTensor)`, `p.device_mesh`,
`p.placements`, `p.full_tensor()`, `p.to_local()` (refused inside that window: below).

It reports the parameter's shape (`shape`, `size()`, `dim()`, `numel()`: LogicalShape in
dtensor_face.py), as FSDP2's DTensor parameters do, so code that groups or initializes by
shape sees the parameter; its values are this rank's 1-D piece.

Indexing it, or its `.data`, selects the parameter's rows (`p[i]`, `p.data[a:b]`), of
which this rank writes its part (piece_rows.py).

Everything else is nn.Parameter's: ops on it return plain tensors, and `p.data = x`
still goes through the unit's own check at the next use (a pointer compare)."""
from __future__ import annotations

import sys
import types
import weakref

import torch
import torch._guards
import torch.nn as nn
from torch.optim import optimizer as _torch_optimizer
from torch.utils import _foreach_utils

from . import piece_rows, state_dict
from .dtensor_face import DTensorFace, LogicalShape, local_shape
from .param_index import aliases_shard, conversion_refused, owner_of, same_slot
from .states import ParamInit

# Tensor's own `data` attribute (a C getset descriptor), which the property below wraps.
_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]
# Tensor's own `is_meta`, which ShardedParameter.is_meta answers for torch and this package.
_TENSOR_IS_META = torch._C.TensorBase.__dict__["is_meta"]
# nn.Module._apply, whose `param.data = fn(param)` the data setter recognises when `fn` is
# nn.Module.to_empty's function (decided by the function, so alike on every rank).
_MODULE_APPLY = nn.Module._apply.__code__
_TO_EMPTY_FNS = frozenset(c for c in nn.Module.to_empty.__code__.co_consts if isinstance(c, types.CodeType))
# What `to_empty()` on a module inside a unit does to one of its parameters (unit state,
# index): set by in_place_init, which imports this module.
emptied_in_unit = None
# Moves a unit's whole shard to a device (unit state, device): set by retype, which
# imports this module.
move_unit = None


def _torch_internal_or_tracing(frame) -> bool:
    """Whether the code at `frame` is torch's own (AOT autograd's dispatch modes, Dynamo,
    nn.Module) or runs under tracing: it gets `.data` as the plain piece it always was."""
    return torch._guards.TracingContext.try_get() is not None or \
        frame.f_globals.get("__name__", "").startswith("torch.")


def is_to_empty_function(fn) -> bool:
    """Whether `fn`, given to nn.Module._apply, is nn.Module.to_empty's function: its
    parameters' values are to be left unwritten, not computed from the old ones. Decided
    by the function, never by what it returns, so alike on every rank and for functions
    that happen to make new tensors (`torch.zeros_like`)."""
    return getattr(fn, "__code__", None) in _TO_EMPTY_FNS


def _assigning_frame():
    """The frame making the assignment the data setter runs for (past the class's own
    __setattr__), for a helper called by the setter."""
    frame = sys._getframe(3)
    if frame.f_code is ShardedParameter.__setattr__.__code__:
        frame = frame.f_back
    return frame


def outermost_converted(module: nn.Module) -> nn.Module:
    """The outermost module whose nn.Module._apply is running around this call
    (`model.cpu()` on a plain parent reaches its fully_shard children's _apply first)."""
    top, frame = module, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _MODULE_APPLY:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, nn.Module):
                top = candidate
        frame = frame.f_back
    return top


def _assigned_by_module_apply() -> bool:
    """Whether the assignment being made (from inside the data setter) is nn.Module._apply's."""
    return _assigning_frame().f_code is _MODULE_APPLY


def _emptied_by_to_empty() -> bool:
    """Whether the assignment being made (from inside the data setter) is
    nn.Module._apply's with nn.Module.to_empty's function."""
    frame = _assigning_frame()
    return frame.f_code is _MODULE_APPLY and is_to_empty_function(frame.f_locals.get("fn"))


def _tp_sharded(state, index: int) -> bool:
    """Whether parameter `index` is sharded by tensor parallelism too (its piece is of
    this rank's TP shard)."""
    spec = state.tp.specs.get(index) if state.tp is not None else None
    return spec is not None and spec.sharded


def _pieces_are_whole(unit) -> bool:
    """Whether every rank's piece of the unit's parameters is the whole parameter (a
    replicated strategy, or a group of one)."""
    return unit.strategy.replicated or unit.world_size == 1


def piece_rows_of(state, index: int):
    """(first element of parameter `index`'s piece in the parameter flattened row-major,
    the parameter's shape there, whether the piece is all of it on every rank) for
    indexing by rows (piece_rows.py); refused for a tensor-parallel
    sharded parameter, whose piece is of this rank's TP shard, not of the parameter."""
    spec = state.unit.param_spec(index)
    if _tp_sharded(state, index):
        raise RuntimeError(
            f"indexing tensor-parallel parameter '{spec.name}' of fully_shard unit '{state.unit.label}' by rows: "
            "its piece is of this rank's tensor-parallel shard, whose rows are not the parameter's. Write "
            "rows before parallelizing, or through full_tensor() / the state dict")
    return spec.slice.param_offset, tuple(spec.shape), _pieces_are_whole(state.unit)


# Code outside torch that asks whether a module is distributed by asking whether any of its
# parameters is a DTensor, at any time (FSDP2's always are): outside the window such a
# check alone sees ours as DTensors. Lightning's ModelParallelStrategy finds the model of a
# checkpoint it saves or loads this way (`_has_dtensor_modules`'s generator, under either
# package name; Python 3.10's code objects have no qualified name).
_DISTRIBUTED_MODULE_CHECKS = frozenset({"lightning.fabric.strategies.model_parallel",
                                        "lightning_fabric.strategies.model_parallel"})


def _asks_if_distributed(frame) -> bool:
    return frame.f_code.co_name == "<genexpr>" and \
        frame.f_globals.get("__name__") in _DISTRIBUTED_MODULE_CHECKS and \
        "_has_dtensor_modules" in getattr(frame.f_code, "co_qualname", "_has_dtensor_modules")


def set_data_unchecked(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param.data = value` past ShardedParameter's setter, which refuses dtype changes:
    for retype.py, which gives a whole unit the new dtype."""
    _TENSOR_DATA.__set__(param, value)


class ShardedParameter(LogicalShape, nn.Parameter, DTensorFace):
    """A sharded parameter of a fully_shard unit (see the module docstring)."""

    def _logical_shape(self) -> torch.Size:
        shape = self.__dict__.get("_mfsdp_face_shape")
        if shape is None:
            state, index = owner_of(self)
            if state is None:
                # A copy (deepcopy) or a parameter whose unit is gone: the piece is all it is.
                return local_shape(self)
            shape = self.__dict__["_mfsdp_face_shape"] = state_dict.face_shape(state, index)
        return shape

    def _piece_rows(self):
        state, index = owner_of(self)
        if state is None:
            return 0, tuple(local_shape(self)), True  # a copy, or its unit is gone: the piece is all it is
        return piece_rows_of(state, index)

    def _owner(self):
        state, index = owner_of(self)
        if state is None:
            raise RuntimeError("this sharded parameter no longer belongs to a fully_shard unit (its module was "
                               "freed or re-sharded); it has no mesh or full value")
        return state, index

    def _face_active(self) -> bool:
        # A reduced gradient not yet consumed by an optimizer step is what makes it a DTensor.
        if not isinstance(self.grad, DTensorFace):
            return False
        owner = self.__dict__.get("_mfsdp_owner")
        state = owner() if owner is not None else None
        return state is None or not state.grads_stepped

    @property
    def is_meta(self) -> bool:
        """True, to code outside torch and this package, while the unit waits for its values
        (built on the meta device; no to_empty(), materialize() or load yet), as FSDP2's
        parameters are meta DTensors until to_empty(). Code that materializes only what is
        meta (Lightning's empty_init: to_empty(), then reset_parameters()) then takes FSDP2's
        way in. The shard itself is allocated (NaN until written): torch and this package see
        that."""
        if _TENSOR_IS_META.__get__(self, type(self)):
            return True
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(("torch.", "megatron_fsdp_ext.")):
            return False
        state, index = owner_of(self)
        return state is not None and state.param_init is ParamInit.DEFERRED \
            and index not in state.loaded_while_deferred

    def _face_asked_by(self, frame) -> bool:
        return _asks_if_distributed(frame)  # the module checks above

    def _face_layout(self):
        return state_dict.face_layout(*self._owner())

    def _face_full_tensor(self) -> torch.Tensor:
        return state_dict.full_param(*self._owner())

    def _face_kind(self) -> str:
        return "parameter"

    def _mfsdp_in_unit(self) -> bool:
        """Whether this parameter still belongs to a live unit (not a copy, nor left behind
        by a unit that is gone)."""
        owner = self.__dict__.get("_mfsdp_owner")
        state = owner() if owner is not None else None
        return state is not None and state.unit is not None

    def _mfsdp_piece_layout(self) -> tuple:
        """Where this parameter's piece lies on every rank of its unit's group (each rank's
        offset in the flattened parameter and length): two parameters' pieces align on
        every rank exactly when these are equal. The same on every rank of the group."""
        state, index = self._owner()
        # Cached by the unit's identity, not by a reference to it: the parameter must not
        # keep a unit (and its buffers) alive after its model is gone.
        cached = self.__dict__.get("_mfsdp_layout_key")
        if cached is None or cached[0] != id(state.unit):
            layout = state.unit.layout
            slices = tuple((s.param_offset, s.numel) for s in (layout.shard_slice(index, r)
                                                                for r in range(layout.world_size)))
            cached = self.__dict__["_mfsdp_layout_key"] = (id(state.unit), slices)
        return cached[1]

    def register_hook(self, hook):
        """Tensor.register_hook: `hook` runs on this parameter's gradient as autograd
        computes it, so on the unsharded parameter the unit installs for forward and
        backward: this rank's full-shape gradient before the reduction, as a plain module's
        hook runs on each DDP rank's local gradient (PEFT's gradient masks and
        projections). What it returns replaces that gradient. (This sharded parameter is
        in no autograd graph: a hook on it alone would never run, as on FSDP2's.)"""
        state, index = owner_of(self)
        if state is None or state.unit is None:
            return super().register_hook(hook)
        return state.unit.unsharded_param(index).register_hook(hook)

    # Matrix products and products with a number: shared with PieceCast, below it.
    # PEFT casts bf16 / fp16 adapters on the CPU to fp32 before multiplying them: the cast
    # is this rank's piece, and a product of two pieces would be a dot product of them.
    # (A cast to the parameter's own dtype is the parameter itself, as torch's.)
    def float(self, *args, **kwargs):
        return PieceCast.of(self, super().float(*args, **kwargs))

    def double(self, *args, **kwargs):
        return PieceCast.of(self, super().double(*args, **kwargs))

    def half(self, *args, **kwargs):
        return PieceCast.of(self, super().half(*args, **kwargs))

    def bfloat16(self, *args, **kwargs):
        return PieceCast.of(self, super().bfloat16(*args, **kwargs))

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's flat piece (a view). Refused while the parameter is a DTensor (between
        backward and the step): FSDP2 code may write FSDP2's rows through it then (torch's
        set_model_state_dict(broadcast_from_rank0=True) does), and they would land in the
        wrong elements, on some ranks without a shape error. Refused on every rank alike."""
        if self._face_active():
            raise NotImplementedError(
                "to_local() of a fully_shard parameter between backward and the optimizer step: it presents "
                "itself as a DTensor there, but its local tensor is this rank's flat piece of its unit's buffer, "
                "not FSDP2's rows, so values written through it would land in the wrong elements. Read the "
                "parameter itself (that piece) or full_tensor(); load state between training steps")
        return super().to_local(grad_placements=grad_placements)

    @property
    def data(self) -> torch.Tensor:
        owner = self.__dict__.get("_mfsdp_owner")
        state = owner() if owner is not None else None
        unit = getattr(state, "unit", None)
        data = _TENSOR_DATA.__get__(self, type(self))
        if unit is None:
            return data
        # An overlapped CPU optimizer step may still be writing this shard.
        unit.wait_host_update()
        unit.shard_changed()
        # Indexed by the parameter's rows (`p.data[padding_idx].zero_()`), as the parameter
        # is, for scripts and libraries. torch's own code (AOT autograd's dispatch modes,
        # Dynamo, nn.Module) and tracing get the plain tensor that `.data` always was:
        # modes refuse tensor subclasses they do not know.
        if _torch_internal_or_tracing(sys._getframe(1)):
            return data
        state, index = owner_of(self)
        if state is None:
            return data
        return piece_rows.piece_data(data, *piece_rows_of(state, index), param=self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if isinstance(value, torch.Tensor) and value.dtype == self.dtype and value.device == self.device \
                and _emptied_by_to_empty():
            # to_empty() on a module inside a unit (torchtune's LoRA adapters, a block of a
            # model built on meta): the piece stays in the unit's shard, which holds
            # uninitialized memory as to_empty's would (in_place_init.py).
            state, index = owner_of(self)
            if state is not None and state.unit is not None and emptied_in_unit is not None \
                    and emptied_in_unit(state, index):
                return
        # A value of the parameter's shape (`p.data = torch.zeros(p.shape)`) is the full
        # value: every rank keeps its slice. Anything else replaces the piece as it is, and
        # the unit checks it at the next use.
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(self._logical_shape()) \
                and tuple(value.shape) != tuple(local_shape(self)):
            state, index = owner_of(self)
            if state is not None and state.unit is not None:
                from .shard_changes import set_full_value

                state.unit.wait_host_update()
                set_full_value(state, index, value.detach())
                return
        if isinstance(value, torch.Tensor) and value.dtype == self.dtype and value.device != self.device \
                and tuple(local_shape(value)) == tuple(local_shape(self)) and move_unit is not None \
                and not _assigned_by_module_apply():
            # `p.data = p.data.to(device)` for every parameter (older verl's parking of a
            # model in host memory): the unit's flat shard moves whole at its first
            # parameter (retype.move_unit), the others then find theirs there; the value
            # given lands in this parameter's piece. (nn.Module._apply of a module inside a
            # unit, `model.norm.cpu()`, would move part of a unit: refused, here or, where
            # it replaces the parameters, by the unit at their next use.)
            state, _ = owner_of(self)
            if state is not None and state.unit is not None:
                move_unit(state, value.device)  # an offloaded unit's shard stays in host memory
                with torch.no_grad():
                    _TENSOR_DATA.__get__(self, type(self)).copy_(value)
                return
        if isinstance(value, torch.Tensor) and (value.dtype != self.dtype or value.device != self.device):
            # nn.Module._apply on a module inside a unit (model.norm.float()) swaps .data
            # here; on the unit's own module FSDPModule._apply refuses it first.
            state, _ = owner_of(self)
            if state is not None and state.unit is not None:
                raise conversion_refused(state.unit.label, self, value.dtype, value.device)
        if isinstance(value, torch.Tensor):
            state, _ = owner_of(self)
            if state is not None and state.unit is not None and state.tp is not None and state.tp.specs \
                    and aliases_shard(state.unit) and not same_slot(value, _TENSOR_DATA.__get__(self, type(self))):
                # no_shard without a cast: the unit's TP DTensor parameters view its shard
                # itself, and a replaced piece moves the shard to new storage behind them.
                raise NotImplementedError(
                    f"`p.data = x` on a parameter of {state} (no_shard, holding tensor- or expert-parallel "
                    "DTensors, which view the unit's shard itself): the shard would move to new storage "
                    "behind them; write in place instead (`with torch.no_grad(): p.copy_(x)`)")
        _TENSOR_DATA.__set__(self, value)

    def __setattr__(self, name: str, value) -> None:
        # A gradient computed from the reduced one (`p.grad = p.grad / 2`, `p.grad + wd * p`)
        # is a plain tensor of the piece's shape: it takes the piece's ShardedGrad type while
        # the unit's gradients carry theirs, so torch's clip after it stays global (FSDP2's
        # arithmetic on a DTensor gradient gives a DTensor). Only sets pay for this: reads
        # of p.grad (every optimizer step, every parameter) stay torch's own.
        if name == "grad" and isinstance(value, torch.Tensor):
            value = self._piece_of_full_grad(value)
        super().__setattr__(name, value)
        if name == "grad" and type(value) is torch.Tensor:
            state, index = owner_of(self)
            if state is not None and state.grads_tagged and local_shape(value) == local_shape(self):
                state.retag_grad(index)

    def _piece_of_full_grad(self, value: torch.Tensor) -> torch.Tensor:
        """A gradient of the parameter's full shape (`p.grad = vec[i:i + n].view(p.shape)`
        after torch's parameters_to_vector, as PCGrad-style code writes a projected vector
        back; FSDP2 takes a full DTensor there): this rank's part of it, as `p.data = x` keeps
        this rank's part. Every rank holds the same full value, so nothing is exchanged."""
        here, full = tuple(local_shape(self)), tuple(self._logical_shape())
        if here == full or tuple(local_shape(value)) != full:
            return value
        state, index = owner_of(self)
        if state is None or state.unit is None or _tp_sharded(state, index):
            return value  # torch's own size error names both shapes
        return state.unit.local_piece(index, value).clone()


class PieceCast(torch.Tensor):
    """A value laid out like a sharded parameter's piece: its cast (`p.float()`,
    `.double()`, `.half()`, `.bfloat16()`), or an elementwise operator (`+ - * /`, `-p`) of
    it with a number or with another parameter's piece (laid out alike, or else taken
    from that parameter's full value where this piece lies), and those of a PieceCast.
    A plain tensor to every op (torch function disabled) but two: its matrix product is
    of the full values (with another PieceCast or a sharded parameter, as the parameters' own product: PEFT's CPU
    merge of bf16 adapters) and refused with anything else (it would be of pieces); and as
    the operand of another parameter's `.data` in-place op it gives its full value
    (PieceData). `_mfsdp_cast_of`: the parameter."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(source: "ShardedParameter", cast: torch.Tensor) -> torch.Tensor:
        if cast is source:
            return source
        out = cast.as_subclass(PieceCast)
        out._mfsdp_cast_of = source
        return out

    @staticmethod
    def elementwise(source: "ShardedParameter", result, operand):
        """`result` of an elementwise op of `source`'s piece with `operand` (already in
        `source`'s layout: piece_rows.in_layout_of): marked as laid out like `source`'s piece
        where the operand is a number or such a piece; plain otherwise (a plain tensor of
        the piece's shape may be anything)."""
        number = isinstance(operand, (int, float)) or (isinstance(operand, torch.Tensor) and operand.dim() == 0
                                                        and piece_rows.piece_param(operand) is None)
        if (number or piece_rows.piece_param(operand) is not None) and type(result) is torch.Tensor:
            return PieceCast.of(source, result)
        return result

    def _mfsdp_full_value(self) -> torch.Tensor:
        """The full value (a collective over its parameter's unit group)."""
        return _full_value(self)

    def __rmatmul__(self, other):
        return self._mfsdp_cast_of._refuse_matmul(other)

    def __reduce_ex__(self, protocol):
        return torch.Tensor.as_subclass(self, torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        out = torch.Tensor.as_subclass(self, torch.Tensor).clone()
        memo[id(self)] = out
        return out


def _matmul(self, other, *args, **kwargs):
    # A product of two sharded parameters (or their casts) is of their full values (a
    # collective, on every rank of both units' groups), as FSDP2's DTensor product: PEFT's
    # merge() computes lora_B.weight @ lora_A.weight and adds it to the base weight's
    # `.data`, which takes this rank's part (piece_rows.PieceData). With anything else, or
    # as in-place product, the pieces would meet: refused (LogicalShape).
    if not isinstance(other, (ShardedParameter, PieceCast)) or args or kwargs:
        owner = self if isinstance(self, ShardedParameter) else self._mfsdp_cast_of
        return owner._refuse_matmul(other, *args, **kwargs)
    return _full_product(self, other)


def _elementwise(name: str):
    """Tensor's operator `name` on a parameter's piece (the parameter, its `.data`, or a
    PieceCast of it): another parameter's piece laid out differently meets this one's as
    the part of its full value where this piece lies (a collective, decided alike on every
    rank: PEFT's safe merge of a LoRA bias, `bias + lora_B.bias * scaling`, where FSDP2's
    DTensors meet shard for shard), and the result keeps the layout (PieceCast.elementwise),
    so `.data`'s in-place ops take it as that parameter's (PEFT's merge: `bias.data +=
    lora_B.bias * scaling`, its full value)."""
    op = getattr(torch.Tensor, name)

    def method(self, *operand):
        source = piece_rows.piece_param(self)
        if source is None:  # a copy, or a parameter whose unit is gone: a plain piece
            return op(self, *operand)
        if not operand:
            return PieceCast.elementwise(source, op(self), 1)
        other = operand[0]
        if isinstance(other, torch.Tensor):
            other = piece_rows.in_layout_of(source, other)
            if other is not operand[0]:
                # Another parameter's values in this piece's layout: laid out alike.
                return PieceCast.of(source, op(self, other))
        return PieceCast.elementwise(source, op(self, other), other)

    method.__name__ = method.__qualname__ = name
    return method


def _in_place(name: str):
    """Tensor's in-place op `name` on a sharded parameter itself (under torch.no_grad()):
    another parameter's piece laid out differently meets this one as the part of that
    parameter's full value where this piece lies (piece_rows.in_layout_of: a collective,
    decided alike on every rank), as `.data`'s in-place ops take it. An EMA model sharded
    as one unit beside a model trained per layer (`ema.lerp_(p, 1 - d)`,
    `ema.mul_(d).add_(p, alpha=1 - d)`, `ema.copy_(p)`): on the pieces these would mix
    elements of different positions, silently where the pieces' lengths agree. Pieces laid
    out alike, gradients, numbers and plain tensors go to torch's op as they are (an
    optimizer's per-parameter step pays one type check per operand)."""
    op = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        source = None if torch.compiler.is_compiling() else piece_rows.piece_param(self)
        if source is not None:
            args = tuple(piece_rows.in_layout_of(source, a) for a in args)
            if kwargs:
                kwargs = {k: piece_rows.in_layout_of(source, v) for k, v in kwargs.items()}
        return op(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _cls in (ShardedParameter, PieceCast):
    _cls.__matmul__ = _cls.matmul = _cls.mm = _matmul

for _name in ("copy_", "add_", "sub_", "mul_", "div_", "lerp_", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
    setattr(ShardedParameter, _name, _in_place(_name))

_ELEMENTWISE = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
                "__neg__")
for _cls in (ShardedParameter, PieceCast, piece_rows.PieceData):
    for _name in _ELEMENTWISE:
        setattr(_cls, _name, _elementwise(_name))


def _full_value(x) -> torch.Tensor:
    """The full value of a sharded parameter, or of a cast of one: the cast's own values
    (a copy, which may have been written since, or the parameter since)."""
    if isinstance(x, PieceCast):
        state, index = x._mfsdp_cast_of._owner()
        return state_dict.full_of_piece(state, index, torch.Tensor.as_subclass(x, torch.Tensor))
    return x.full_tensor()


def _full_product(a, b) -> torch.Tensor:
    """a @ b of the full values (a collective over both units' groups), a plain tensor on
    every rank; in a graph that needs gradients, one whose backward refuses."""
    with torch.no_grad():
        product = torch.matmul(_full_value(a), _full_value(b))
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _NoGradientThroughFullProduct.apply(product, a, b)
    return product


class _NoGradientThroughFullProduct(torch.autograd.Function):
    """The product of two sharded parameters' full values in a graph that needs
    gradients: a backward through it would have to reduce each rank's full gradient into
    the pieces. Refused when it runs (PEFT's merge only reads the product's values)."""

    @staticmethod
    def forward(ctx, product, a, b):
        return product.view_as(product)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "backward through a matrix product of two fully_shard parameters (p @ q outside their units' "
            "forward): the product is of their full values on every rank, and a gradient through it is not "
            "supported. Compute it inside a module's forward (a unit of both), or under torch.no_grad()")


def refuse_gradients_into_piece(param: ShardedParameter) -> None:
    """Guards `param` against autograd writing a gradient into it directly. Forward and
    backward run on the unsharded parameter the unit installs, so the sharded one enters a
    graph only through code that computed on it outside its unit's forward: a weight
    penalty or a distance to another model summed over `model.parameters()`. That term is
    of this rank's piece, its value and, unless it is elementwise, its gradient not the
    parameter's (FSDP2 refuses it at once: its DTensor meets a plain loss). Refused in the
    backward on every rank that computed it, naming the parameter, where the piece is part
    of the parameter; where it is all of it (no_shard, one rank) the term is the
    parameter's and trains as in one process. Taken while the module holds the gathered
    parameters (after the forward under reshard_after_forward=False, or in a forward
    hook), the term is the parameter's and never reaches this one.

    A leaf's hook runs only when autograd reaches it, so this costs nothing in a step
    that never does. Registered while `param` requires grad, so it stays through
    freezing and unfreezing."""
    ref = weakref.ref(param)

    def refuse(grad):
        p = ref()
        state, index = owner_of(p) if p is not None else (None, -1)
        if state is None:
            return None  # left behind by its unit: the piece is all it is
        unit = state.unit
        if not _tp_sharded(state, index) and _pieces_are_whole(unit):
            return None
        raise RuntimeError(
            f"a gradient reached fully_shard parameter '{unit.param_spec(index).name}' of unit '{unit.label}' "
            "itself: a loss term computed from the sharded parameter outside its unit's forward (a weight "
            "penalty over model.parameters(), a distance to other weights) is of this rank's piece, so its "
            "value and gradient are not the parameter's. Use the optimizer's weight_decay for an L2 penalty, or "
            "take the term while the unit holds its gathered parameters, from its forward to its backward under "
            "reshard_after_forward=False (model.parameters() after the forward, or a forward hook of the "
            "unit's module): each rank adds the whole term, and the reduction averages it as the loss")

    frozen = not param.requires_grad
    if frozen:
        torch.Tensor.requires_grad_(param, True)
    torch.Tensor.register_hook(param, refuse)
    if frozen:
        torch.Tensor.requires_grad_(param, False)


def _refuse_moved_registration(module: nn.Module, name: str, param) -> None:
    """torch's global parameter-registration hook: a sharded parameter of a live unit
    registered again under another name of the module that holds it
    (torch.nn.utils.prune's `weight_orig`), or into a parametrization
    (torch.nn.utils.parametrize's `original`), is refused by name before anything moves.
    Both compute the module's tensor from it in a hook of their own, on this rank's piece:
    the pruning mask is of piece elements (some ranks fail, the others wait in the next
    gather). Decided by the modules' slots, alike on every rank. Assigning a parameter to
    its own slot again (a re-tie of tied weights) passes."""
    if not isinstance(param, ShardedParameter) or module._parameters.get(name) is param \
            or not param._mfsdp_in_unit():
        return None
    from torch.nn.utils import parametrize

    renamed = any(p is param for p in module._parameters.values())
    if renamed or isinstance(module, parametrize.ParametrizationList):
        state, index = param._owner()
        raise NotImplementedError(
            f"registering parameter '{state.names[index]}' of {state} again as '{name}' of a "
            f"{type(module).__name__} (what torch.nn.utils.prune and torch.nn.utils.parametrize do, to compute the "
            "module's tensor from it in a hook of their own): inside a fully_shard unit the parameter is this "
            "rank's piece, gathered only into its own slot. Prune or parametrize before fully_shard and make it "
            "permanent (prune.remove, parametrize.remove_parametrizations), or apply the mask in the module's forward")
    return None


nn.modules.module.register_module_parameter_registration_hook(_refuse_moved_registration)


# torch's optimizers take their foreach and fused paths, and clip_grad_norm_ its foreach
# path, only for tensor types listed here (DTensor lists itself the same way); unlisted,
# AdamW would update our parameters one tensor at a time.
for _types in (_torch_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if ShardedParameter not in _types:
        _types.append(ShardedParameter)
