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

So indexing whole rows gives a `RowPiece`: a plain view of this rank's part of the rows (its
length differs between ranks). Writes through it (`zero_`, `fill_`, `mul_`, ...) land in
the rows; its `copy_` and the parameter's `p[rows] = value` take a value of the rows' full
shape (or one broadcastable to it) and keep this rank's part. Reads of it are this rank's
part, as every op on a piece is. Anything else (columns, steps, index tensors, masks, a
piece of another parameter as the value) is refused by name, on every rank alike: the
decisions depend on the parameter's shape and the index, never on the piece.
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
        index = index[0]
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
    Ops on it are plain tensor ops (no per-op Python); `copy_` takes a value of the rows'
    full shape."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def copy_(self, src, non_blocking: bool = False):
        first, end, shape = self._mfsdp_rows
        part = _part_of(src, first, end, shape, self._mfsdp_start, torch.Tensor.numel(self), "copy_ into")
        return torch.Tensor.copy_(self, part, non_blocking)

    def __reduce_ex__(self, protocol):
        return torch.Tensor.detach(self).as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None) -> str:
        first, end, shape = self._mfsdp_rows
        plain = torch.Tensor.as_subclass(self, torch.Tensor)
        return f"RowPiece(rows of shape {shape}, this rank's part={plain!r})"


def _part_of(value, first: int, end: int, shape, start: int, count: int, what: str):
    """The elements [start, start + count) of `value` broadcast to the rows' full `shape`
    (the rows spanning elements [first, end) of the parameter)."""
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
    n = torch._C.TensorBase.numel(piece)
    a, b = max(first, offset), min(end, offset + n)
    if b <= a:  # none of these rows here: an empty view at a valid place in the piece
        return min(max(first, offset), offset + n), 0
    return a, b - a


def _plain_index(piece: torch.Tensor, shape, whole: bool, index):
    """The tensor to index as torch would, or None for rows of a piece: the parameter
    itself where the piece is all of it on every rank (`whole`: a replicated unit, or a
    group of one), or the piece where the index is a mask of the piece's own shape
    (`g[torch.isnan(g)] = 0`: elementwise, the same on every rank)."""
    with DisableTorchFunctionSubclass():
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool \
                and tuple(torch.Tensor.size(index)) == tuple(torch.Tensor.size(piece)):
            return torch.Tensor.view(piece, -1)
        if whole:
            return torch.Tensor.view(piece, shape)
    return None


def get_rows(piece: torch.Tensor, offset: int, shape, whole: bool, index):
    """`piece[index]` read as rows of the parameter: this rank's part, a view."""
    plain = _plain_index(piece, shape, whole, index)
    if plain is not None:
        with DisableTorchFunctionSubclass():
            return torch.Tensor.__getitem__(plain, index)
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
    whose indexing is by the parameter's rows, as the parameter's own."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, index):
        return get_rows(self, *self._mfsdp_piece, index)

    def __setitem__(self, index, value) -> None:
        set_rows(self, *self._mfsdp_piece, index, value)

    def __iter__(self):
        raise TypeError(f"iterating over .data of a fully_shard parameter of shape {self._mfsdp_piece[1]}: its values "
                        "are this rank's 1-D piece; iterate over full_tensor() (a collective) or the piece "
                        "(.view(-1))")

    def __reduce_ex__(self, protocol):
        return torch.Tensor.detach(self).as_subclass(torch.Tensor).__reduce_ex__(protocol)


def piece_data(data: torch.Tensor, offset: int, shape, whole: bool) -> PieceData:
    out = data.as_subclass(PieceData)
    out._mfsdp_piece = (offset, tuple(shape), whole)
    return out
