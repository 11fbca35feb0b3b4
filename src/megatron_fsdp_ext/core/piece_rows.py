"""Rows of a sharded parameter, read and written through this rank's piece.

A sharded parameter (or gradient) holds elements [offset, offset + n) of the parameter
flattened in row-major order. Selecting whole rows (`p[i]`, `p[a:b]`, `p[i, :]`) therefore
selects the contiguous elements [i * row, (i + 1) * row), and their intersection with the
piece is a contiguous part of it: each rank can write its share of those rows with no
communication. This is what scripts do to parameters outside the forward:
`init.zeros_(emb.weight[padding_idx])` (Hugging Face's `_init_weights`),
`emb.weight.data[pad].zero_()`, `emb.weight.grad[:n_old] = 0` (train new token rows only).
Indexing the 1-D piece itself would write element i of every rank's piece instead of row
i, silently (FSDP2's DTensor writes nothing there).

So indexing whole rows gives a `RowPiece`: a view of this rank's part of the rows (its
length differs between ranks). Writes through it (`zero_`, `fill_`, `mul_`, ...) land in
the rows; an operand of the rows' full shape (or one broadcastable to it), in its ops and
in `p[rows] = value`, gives this rank's part. Reads of it are this rank's part, as every
op on a piece is. A boolean mask of the parameter's shape selects its elements on every
piece; one of the piece's own shape is elementwise. Anything else (columns, steps, index
tensors, other rows or a whole piece as an operand) is refused by name, on every rank
alike: the decisions depend on the parameter's shape and the index, never on the piece.
"""
from __future__ import annotations

import math
import operator
from typing import Tuple

import torch
from torch._C import DisableTorchFunctionSubclass


def _refuse(what: str, shape, why: str) -> RuntimeError:
    return RuntimeError(
        f"{what} of a fully_shard parameter or gradient of shape {tuple(shape)}: {why}. Its values are this "
        "rank's 1-D piece of the parameter; only whole rows (p[i], p[a:b], p[i, :]) map onto the piece. Write "
        "other parts before fully_shard, or through full_tensor() / the state dict")


def _row_index(i, rows: int, shape) -> int:
    try:
        i = operator.index(i)
    except TypeError:
        raise _refuse("indexing", shape, f"index {i!r} is neither whole rows nor an integer") from None
    if not -rows <= i < rows:
        raise IndexError(f"index {i} is out of bounds for dimension 0 with size {rows}")
    return i + rows if i < 0 else i


def selected_rows(shape, index) -> Tuple[int, int, Tuple[int, ...]]:
    """(first element, end element, full shape) of the rows `index` selects in a parameter
    of `shape`, counted in the parameter flattened row-major. Raises for anything that is
    not whole rows."""
    shape = tuple(shape)
    if not shape:
        raise _refuse("indexing", shape, "a 0-dim parameter has no rows")
    if isinstance(index, tuple):
        rest = index[1:]
        if not index or any(not (r is Ellipsis or (isinstance(r, slice) and r == slice(None))) for r in rest) \
                or sum(r is Ellipsis for r in index) > 1:
            raise _refuse("indexing", shape, f"index {index!r} selects parts of rows")
        if sum(r is not Ellipsis for r in index) > len(shape):
            raise IndexError(f"too many indices for a parameter of shape {shape}: {index!r}")
        index = index[0]
    if index is None or isinstance(index, bool) or (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
        raise _refuse("indexing", shape, f"index {index!r} adds a dimension or masks")
    rows = shape[0]
    row = math.prod(shape[1:])
    if index is Ellipsis:
        return 0, rows * row, shape
    if isinstance(index, slice):
        if index.step not in (None, 1):
            raise _refuse("indexing", shape, f"slice {index!r} has a step")
        first, end, _ = index.indices(rows)
        end = max(end, first)
        return first * row, end * row, (end - first,) + shape[1:]
    if isinstance(index, torch.Tensor) and (index.dim() != 0 or index.is_floating_point() or index.dtype == torch.bool):
        raise _refuse("indexing", shape, "index tensors and masks select scattered elements")
    i = _row_index(index, rows, shape)
    return i * row, (i + 1) * row, shape[1:]


class RowPiece(torch.Tensor):
    """This rank's part of whole rows of a sharded parameter (see the module docstring).
    A tensor operand of the rows' full shape, or broadcastable to it, takes its part of
    this rank's window (`p[i].copy_(row)`, `p.data[i].add_(row)`); indexing it again
    selects within the rows the same way. Elementwise results stay RowPieces of the same
    window; other results are plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            own = next((a for a in args if isinstance(a, RowPiece)), None)
            if own is None or func in _READS_ONLY:
                return func(*args, **kwargs)
            first, end, shape = own._mfsdp_rows
            start, count = own._mfsdp_start, torch.Tensor.numel(own)
            if func is torch.Tensor.copy_:
                src = args[1] if len(args) > 1 else kwargs["src"]
                if not (isinstance(src, RowPiece) and src._mfsdp_rows[:2] == (first, end)):
                    _part_of(src, first, end, shape, start, count, "copy_ into")  # refuses pieces by name
            args = tuple(_operand_part(a, own) for a in args)
            kwargs = {k: _operand_part(v, own) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            # An elementwise result is of the same rows and window: it stays a RowPiece, so
            # it can meet this one again (`p[i] += p[i] * 2`).
            if type(out) is torch.Tensor and out.dim() == 1 and out.numel() == count:
                out = out.as_subclass(RowPiece)
                out._mfsdp_rows, out._mfsdp_start, out._mfsdp_source = own._mfsdp_rows, start, None
            return out

    def __getitem__(self, index):
        first, end, shape = self._mfsdp_rows
        return get_rows(self, self._mfsdp_start - first, shape, False, index)

    def __setitem__(self, index, value) -> None:
        first, end, shape = self._mfsdp_rows
        set_rows(self, self._mfsdp_start - first, shape, False, index, value)

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo)

    def __reduce_ex__(self, protocol):
        return torch.Tensor.detach(self).as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None) -> str:
        first, end, shape = self._mfsdp_rows
        plain = torch.Tensor.as_subclass(self, torch.Tensor)
        return f"RowPiece(rows of shape {shape}, this rank's part={plain!r})"


# What a RowPiece is asked without its values being combined with anything.
_READS_ONLY = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
               torch.Tensor.__deepcopy__, torch.Tensor.__reduce_ex__}


def _plain_copy(t: torch.Tensor, memo) -> torch.Tensor:
    """copy.deepcopy of a view of a piece: a plain copy of this rank's values (torch's
    default goes through new_empty, which is plain here, and refuses)."""
    with DisableTorchFunctionSubclass():
        out = torch.Tensor.clone(t).as_subclass(torch.Tensor)
    memo[id(t)] = out
    return out


def _operand_part(a, own: "RowPiece"):
    """An operand of an op on the RowPiece `own`: a plain tensor of at least one dim that
    broadcasts to the rows' full shape gives this rank's part of it; a RowPiece of the
    same rows is in the same window already; scalars, 0-dim tensors and tensors that do
    not broadcast are used as they are. A RowPiece of other rows, or a sharded parameter
    or gradient, is refused by name (their elements differ between ranks)."""
    first, end, shape = own._mfsdp_rows
    a = _full_if_marked(a)
    if isinstance(a, RowPiece):
        if a is own or a._mfsdp_rows[:2] == (first, end):
            return a
        raise _refuse("an op on rows", shape, f"another tensor of other rows of a sharded parameter meets them "
                      f"(elements {a._mfsdp_rows[0]}-{a._mfsdp_rows[1]} against {first}-{end})")
    if not isinstance(a, torch.Tensor):
        return a
    if isinstance(a, PieceData) or hasattr(type(a), "_logical_shape"):
        raise _refuse("an op on rows", shape, "a whole piece of a sharded parameter or gradient meets them")
    with DisableTorchFunctionSubclass():
        if torch.Tensor.dim(a) == 0:
            return a
        try:
            if torch.broadcast_shapes(tuple(torch.Tensor.size(a)), tuple(shape)) != tuple(shape):
                return a
        except RuntimeError:
            return a
        count = torch.Tensor.numel(own)
    return _part_of(a, first, end, shape, own._mfsdp_start, count, "an operand of")


def _part_of(value, first: int, end: int, shape, start: int, count: int, what: str):
    """The elements [start, start + count) of `value` broadcast to the rows' full `shape`
    (the rows spanning elements [first, end) of the parameter)."""
    value = _full_if_marked(value)
    # A piece's elements differ between ranks: RowPiece, PieceData, or a sharded
    # parameter or gradient (LogicalShape's `_logical_shape`).
    if isinstance(value, (RowPiece, PieceData)) or hasattr(type(value), "_logical_shape"):
        raise _refuse(what + " rows", shape, "the value is itself a piece of a sharded parameter or gradient "
                      "(its elements differ between ranks); use full_tensor() of it")
    if not isinstance(value, torch.Tensor):
        return value
    with DisableTorchFunctionSubclass():
        try:
            whole = value.expand(shape)
        except RuntimeError:
            raise _refuse(what + " rows", shape, f"a value of shape {tuple(value.shape)} does not broadcast to "
                          f"the rows' shape {tuple(shape)}") from None
        flat = whole.reshape(-1)
        return flat.narrow(0, start - first, count) if count else flat[:0]


def _window(piece: torch.Tensor, offset: int, first: int, end: int) -> Tuple[int, int]:
    """(start element in the parameter, count) of this rank's part of [first, end)."""
    with DisableTorchFunctionSubclass():
        n = torch.Tensor.numel(piece)
    a, b = max(first, offset), min(end, offset + n)
    if b <= a:  # none of these rows here: an empty view at a valid place in the piece
        return min(max(first, offset), offset + n), 0
    return a, b - a


def _plain_index(piece: torch.Tensor, shape, whole: bool, index):
    """The tensor to index as torch would, or None for rows of a piece: the parameter
    itself where the piece is all of it on every rank (`whole`: a replicated unit, or a
    group of one)."""
    if whole:
        with DisableTorchFunctionSubclass():
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool \
                    and tuple(torch.Tensor.size(index)) == tuple(torch.Tensor.size(piece)) != tuple(shape):
                return torch.Tensor.view(piece, -1)  # a mask built from the piece: elementwise
            return torch.Tensor.view(piece, shape)
    return None


def _mask_on_piece(piece: torch.Tensor, offset: int, shape, mask: torch.Tensor):
    """(this rank's 1-D piece, the mask over it, elements the mask selects before the
    piece) for a boolean mask: one of the parameter's shape gives its window over the
    piece (`p[p.abs() > t]` built from the full value); one of the piece's own shape
    (`g[torch.isnan(g)] = 0`) is elementwise. The parameter's shape is asked first, so a
    rank whose piece is a whole 1-D parameter decides as the others."""
    with DisableTorchFunctionSubclass():
        flat = torch.Tensor.view(piece, -1)
        n = torch.Tensor.numel(flat)
        # A mask that is itself a gradient piece (`torch.isnan(g)` keeps g's type) reports
        # the parameter's shape but holds the piece's: told by its storage, never whole.
        held = tuple(torch.Tensor.size(mask))
        if held == tuple(mask.shape) == tuple(shape):
            whole_mask = mask.reshape(-1)
            return flat, whole_mask.narrow(0, offset, n), whole_mask.narrow(0, 0, offset)
        if held == tuple(torch.Tensor.size(piece)):
            return flat, mask.reshape(-1), None
    raise _refuse("a boolean mask", shape, f"a mask of shape {tuple(mask.shape)} is neither the parameter's shape "
                  "nor this rank's piece's")


def get_rows(piece: torch.Tensor, offset: int, shape, whole: bool, index):
    """`piece[index]` read as rows of the parameter: this rank's part, a view."""
    plain = _plain_index(piece, shape, whole, index)
    if plain is not None:
        with DisableTorchFunctionSubclass():
            return torch.Tensor.__getitem__(plain, index)
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        flat, mask, _ = _mask_on_piece(piece, offset, shape, index)
        with DisableTorchFunctionSubclass():
            return torch.Tensor.__getitem__(flat, mask)  # this rank's selected elements
    first, end, rows_shape = selected_rows(shape, index)
    start, count = _window(piece, offset, first, end)
    with DisableTorchFunctionSubclass():
        view = torch.Tensor.narrow(piece, 0, start - offset, count)
    out = view.as_subclass(RowPiece)
    out._mfsdp_rows = (first, end, rows_shape)
    out._mfsdp_start = start
    out._mfsdp_source = id(piece)
    return out


def set_rows(piece: torch.Tensor, offset: int, shape, whole: bool, index, value) -> None:
    """`piece[index] = value` as rows of the parameter: this rank's part of them."""
    plain = _plain_index(piece, shape, whole, index)
    if plain is not None:
        with DisableTorchFunctionSubclass():
            torch.Tensor.__setitem__(plain, index, value)
        return
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        flat, mask, before = _mask_on_piece(piece, offset, shape, index)
        with DisableTorchFunctionSubclass():
            if before is not None and isinstance(value, torch.Tensor) and torch.Tensor.numel(value) > 1:
                # One value per selected element of the whole mask: this rank's run of them.
                if torch.Tensor.dim(value) != 1 or torch.Tensor.numel(value) != int(index.sum()):
                    raise _refuse("assignment through a boolean mask", shape, f"a value of shape "
                                  f"{tuple(value.shape)} is neither a scalar nor one value per selected element")
                value = value.narrow(0, int(before.sum()), int(mask.sum()))
            torch.Tensor.__setitem__(flat, mask, value)
        return
    first, end, rows_shape = selected_rows(shape, index)
    if isinstance(value, RowPiece) and value._mfsdp_source == id(piece) and value._mfsdp_rows == (first, end, rows_shape):
        return  # `p[rows] += x`: Python writes back the view the in-place op already wrote
    start, count = _window(piece, offset, first, end)
    part = _part_of(value, first, end, rows_shape, start, count, "assignment to")
    with DisableTorchFunctionSubclass():
        view = torch.Tensor.narrow(piece, 0, start - offset, count)
        if isinstance(part, torch.Tensor):
            torch.Tensor.copy_(view, part)
        else:
            torch.Tensor.fill_(view, part)


class PieceData(torch.Tensor):
    """`p.data` of a sharded parameter: the piece itself (plain ops, no per-op Python),
    whose indexing is by the parameter's rows, as the parameter's own, and whose in-place
    ops with an operand of the parameter's full shape write this rank's part of it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, index):
        return get_rows(self, *self._mfsdp_piece, index)

    def __setitem__(self, index, value) -> None:
        set_rows(self, *self._mfsdp_piece, index, value)

    def clone(self, *args, **kwargs):
        # A copy laid out like the piece (PEFT's safe merge adds the full delta to a clone
        # of `.data`, then assigns it back): rows, full-shape operands and `p.data = copy`
        # work on it as on `.data` itself.
        with DisableTorchFunctionSubclass():
            out = torch.Tensor.clone(self, *args, **kwargs)
        return piece_data(out, *self._mfsdp_piece, param=self.__dict__.get("_mfsdp_param"))

    def __iter__(self):
        raise TypeError(f"iterating over .data of a fully_shard parameter of shape {self._mfsdp_piece[1]}: its values "
                        "are this rank's 1-D piece; iterate over full_tensor() (a collective) or the piece "
                        "(.view(-1))")

    def __reduce_ex__(self, protocol):
        return torch.Tensor.detach(self).as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return _plain_copy(self, memo)

    def __repr__(self, *, tensor_contents=None) -> str:
        # torch's printer shortens long tensors by indexing them, which here means rows.
        plain = torch.Tensor.as_subclass(self, torch.Tensor)
        return f"PieceData(parameter shape {self._mfsdp_piece[1]}, this rank's piece={plain!r})"


def _full_if_marked(a):
    """A value marked as a sharded parameter's piece (a PieceCast) as its full value (a
    collective, decided by its type alike on every rank); anything else as it is."""
    if isinstance(a, torch.Tensor) and getattr(a, "_mfsdp_cast_of", None) is not None:
        return a._mfsdp_full_value()
    return a


def _is_sharded_param(a) -> bool:
    """Whether `a` is a sharded parameter itself (not its `.data` or a cast of it)."""
    return hasattr(type(a), "_mfsdp_piece_layout")


def _live(param):
    """`param` while it belongs to a unit; None for a copy or a parameter whose unit is
    gone (its piece is all it is: plain ops)."""
    return param if param is not None and param._mfsdp_in_unit() else None


def _of_another(a, param) -> bool:
    """Whether `a` is a piece of a sharded parameter other than `param` that does not
    line up with `param`'s piece: another parameter itself, its `.data` or a value marked
    as laid out like it (PieceCast), laid out differently (TRL's sync of a
    reference model sharded as one unit with a policy sharded per layer: `ref.data.mul_(
    1 - a).add_(policy.data, alpha=a)`; PEFT's safe merge of a LoRA bias: `bias + lora_B.bias
    * scaling`). Decided by types and by where the pieces lie on every rank, so alike on
    every rank; a parameter or `.data` laid out alike stays elementwise."""
    other = piece_param(a)
    return other is not None and param is not None and other is not param and \
        other._mfsdp_piece_layout() != param._mfsdp_piece_layout()


def piece_param(a):
    """The sharded parameter whose piece `a` is (the parameter itself, its `.data`, or a
    value marked as laid out like it: PieceCast), or None for any other value."""
    if not isinstance(a, torch.Tensor):
        return None
    source = getattr(a, "_mfsdp_cast_of", None)
    if source is not None:
        return _live(source)
    if isinstance(a, PieceData):
        return _live(a.__dict__.get("_mfsdp_param"))
    return _live(a) if _is_sharded_param(a) else None


def _full_value_of(a) -> torch.Tensor:
    """The full value of another parameter's piece (_of_another): a collective."""
    if isinstance(a, PieceData):
        return a.__dict__["_mfsdp_param"].full_tensor()
    if _is_sharded_param(a):
        return a.full_tensor()
    return a._mfsdp_full_value()


def in_layout_of(param, a):
    """`a` as an elementwise operand of `param`'s piece: another parameter's piece laid
    out differently (_of_another) gives this rank's window of that parameter's full value
    where `param`'s piece lies (a collective, decided alike on every rank); anything else
    is `a` itself."""
    if not _of_another(a, param):
        return a
    try:
        offset = param._piece_rows()[0]
    except RuntimeError as e:  # a tensor-parallel piece: of this rank's TP shard, not of the parameter
        raise RuntimeError(f"an operator between two fully_shard parameters laid out differently: {e}") from None
    full = _full_value_of(a)
    with DisableTorchFunctionSubclass():
        n = torch._C.TensorBase.numel(param)  # the piece's (the parameter reports its own shape)
        return torch.Tensor.reshape(full, (-1,)).narrow(0, offset, n)


def _by_rows_when_full(name: str):
    """PieceData's in-place op `name`, where an operand of the parameter's full shape
    gives this rank's part of it, as an operand of whole rows does: `p.data += delta`
    (PEFT's merge() of a LoRA adapter), `p.data.copy_(full)`. Only for parameters of two
    or more dims: a piece is 1-D, so an operand of their shape is never a piece and every
    rank decides alike. A 1-D parameter's full shape is also the shape of a piece that is
    a whole parameter on one rank only (`w.data += v * 2`, v's piece whole on rank 0): its
    ops stay elementwise on the piece, as before."""
    plain = getattr(torch.Tensor, name)

    def op(self, *args, **kwargs):
        shape = self._mfsdp_piece[1]
        # Another parameter's piece, marked as such (a PieceCast: `lora_B.bias * scaling`,
        # PEFT's merge of a LoRA bias), is laid out like that parameter: its full value
        # (a collective, decided by its type alike on every rank) takes this one's part.
        own = self.__dict__.get("_mfsdp_param")
        others = [_of_another(a, own) for a in args]
        other_kwargs = {k: _of_another(v, own) for k, v in kwargs.items()}
        if any(others) or any(other_kwargs.values()):
            args = tuple(_full_value_of(a) if other else a for a, other in zip(args, others))
            kwargs = {k: _full_value_of(v) if other_kwargs[k] else v for k, v in kwargs.items()}
            full = True
        else:
            with DisableTorchFunctionSubclass():
                full = len(shape) >= 2 and any(isinstance(a, torch.Tensor) and tuple(torch.Tensor.size(a)) == shape
                                               for a in (*args, *kwargs.values()))
        if not full:
            return plain(self, *args, **kwargs)
        getattr(self[...], name)(*args, **kwargs)  # the rows of all of it: the operand takes its part
        return self

    op.__name__ = op.__qualname__ = name
    return op


for _name in ("copy_", "add_", "sub_", "mul_", "div_", "lerp_", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
    setattr(PieceData, _name, _by_rows_when_full(_name))


def piece_data(data: torch.Tensor, offset: int, shape, whole: bool, param=None) -> PieceData:
    out = data.as_subclass(PieceData)
    out._mfsdp_piece = (offset, tuple(shape), whole)
    out._mfsdp_param = param  # the sharded parameter whose `.data` this is
    return out
