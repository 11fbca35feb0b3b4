"""DTensor identity for sharded parameters and their reduced gradients.

FSDP2's parameters and gradients are DTensors, and code written for it asks them so:
torchtitan's expert-parallel clip asserts `isinstance(p, DTensor) and isinstance(p.grad,
DTensor)` and splits the parameters by `p.device_mesh.mesh_dim_names`. Ours are plain
1-D pieces of a unit's flat buffer, which no DTensor placement describes, so they cannot
be DTensors (DTensor's dispatch would run on them, and its slots do not fit a gradient
retyped in place). They carry this face instead:

- `isinstance(x, DTensor)` is true for a gradient piece (ShardedGrad) and for a sharded
  parameter while it holds one: from the end of its unit's backward until the optimizer
  step (the window in which FSDP2 users' clipping and gradient inspection run). `type(x)`
  is unchanged, so dispatch, torch's foreach / fused optimizers and torch.compile see the
  plain tensor they always saw. Outside that window a parameter is not a DTensor: torch's
  state-dict helpers then treat it as the plain tensor it is, as they always did.
- `device_mesh` and `placements` (always present): the mesh and placements of the
  parameter's state-dict DTensors (FSDP2's), the data-parallel shard dim given as
  `FlatShard(dim)`, a `Shard(dim)` to torch's DTensor code.
- `to_local()`: the flat piece (a view); `full_tensor()`: the full value (a collective
  over the unit's group, as with FSDP2). A parameter's `to_local()` is refused while it
  is a DTensor: FSDP2 code may write FSDP2's rows through it then (torch's
  set_model_state_dict with broadcast_from_rank0), which would land in the wrong elements.
- `redistribute()` and the DTensor internals (`_spec`) are refused by name.
"""
from __future__ import annotations

import math
import sys
from typing import Tuple

import torch
import torch._guards
from torch._C import DisableTorchFunctionSubclass
from torch.distributed.tensor import DTensor, Shard

from . import piece_rows

_PARAMETERS_TO_VECTOR = torch.nn.utils.convert_parameters.parameters_to_vector.__code__
_VECTOR_TO_PARAMETERS = torch.nn.utils.convert_parameters.vector_to_parameters.__code__


class FlatShard(Shard):
    """The placement of a sharded parameter on its data-parallel shard dim. For torch's
    DTensor code it is `Shard(dim)`: the rows FSDP2 gives each rank, which is how state
    dicts and torch.distributed.checkpoint place this parameter's values. The parameter's
    live local tensor (`to_local()`) is this rank's flat piece of its unit's buffer."""

    def __repr__(self) -> str:
        return f"FlatShard(dim={self.dim})"

    def __str__(self) -> str:
        return f"FS({self.dim})"


_tracing_context = torch._guards.TracingContext.try_get

# Tensor's own shape getter, which LogicalShape shadows: the size of the storage view.
_TENSOR_SHAPE = torch._C.TensorBase.__dict__["shape"]


def local_shape(t: torch.Tensor) -> torch.Size:
    """The shape of `t` itself: for a sharded parameter or gradient (LogicalShape), this
    rank's 1-D piece, not the parameter's shape it reports."""
    with DisableTorchFunctionSubclass():  # a gradient's __torch_function__ is not asked
        return _TENSOR_SHAPE.__get__(t, type(t))


def local_numel(t: torch.Tensor) -> int:
    """The number of elements of `t` itself (this rank's piece; see local_shape)."""
    with DisableTorchFunctionSubclass():
        return torch._C.TensorBase.numel(t)


class LogicalShape:
    """Shape queries answered with the parameter's shape, as FSDP2's DTensor parameters
    and gradients answer them: `shape`, `size()`, `dim()`, `ndim`, `numel()` /
    `nelement()`, `ndimension()` (but to torch.nn.init: below), and so `len()`. Code that decides by shape sees the
    parameter, not this rank's 1-D piece: weight decay for `p.dim() >= 2` (nanoGPT),
    Megatron's `len(p.shape) == 1` no-decay rule, nn.init's fan-in, parameter counts.

    Values are still the piece's: every op, `.data`, `.detach()`, `to_local()`, C++ and
    torch's optimizer kernels see the storage as it is (`local_shape`, `local_numel`), so
    code that shapes values by these answers (`p.view(p.shape)`) fails loudly, as with a
    DTensor. A subclass gives the shape in `_logical_shape()`. Listed before torch.Tensor
    among the bases, so that these shadow Tensor's own."""

    __slots__ = ()

    def _logical_shape(self) -> torch.Size:
        raise NotImplementedError

    def _reported_shape(self) -> torch.Size:
        # torch.compile reads tensors' metadata through these same Python methods while it
        # traces (and pairs it with the storage's strides): it must see the storage as it
        # is, the shape its compiled code will run on.
        if _tracing_context() is not None:
            return local_shape(self)
        return self._logical_shape()

    @property
    def shape(self) -> torch.Size:
        return self._reported_shape()

    def size(self, dim=None):
        shape = self._reported_shape()
        if dim is None:
            return shape
        if not -len(shape) <= dim < len(shape):
            raise IndexError(f"Dimension out of range (the parameter has shape {tuple(shape)}; got dim {dim})")
        return shape[dim]

    def dim(self) -> int:
        return len(self._reported_shape())

    def ndimension(self) -> int:
        # The parameter's dims, as dim() (code that groups parameters by
        # `p.ndimension() < 2` sees the parameter), except to torch.nn.init: its structural
        # initializers (eye_, orthogonal_, dirac_, sparse_) test ndimension() before
        # writing a whole matrix into the tensor (eye_ through out=, which would resize the
        # piece over its neighbours in the flat buffer), so they get the piece's 1 dim and
        # refuse on every rank (until training starts in_place_init runs them on the whole
        # parameter instead); the fan-in of the other initializers (dim()) is the parameter's.
        if sys._getframe(1).f_globals.get("__name__") == "torch.nn.init":
            return len(local_shape(self))
        return len(self._reported_shape())

    @property
    def ndim(self) -> int:
        return len(self._reported_shape())

    def numel(self) -> int:
        if sys._getframe(1).f_code is _VECTOR_TO_PARAMETERS and not self._piece_rows()[2]:
            # It writes `vec[i:i + p.numel()].view_as(p)`: view_as takes the piece's shape,
            # so it would fail on the ranks whose piece is shorter and write the others.
            raise NotImplementedError(
                f"torch's vector_to_parameters on a fully_shard parameter of shape {tuple(self._logical_shape())}: "
                "it reshapes each slice of the vector by view_as, which sees this rank's piece. Write the vector "
                "back as full values: `p.data = vec[i:i + p.numel()].view(p.shape)` for each parameter (every "
                "rank keeps its part; parameters_to_vector gives the full vector)")
        return math.prod(self._reported_shape())

    nelement = numel

    def view(self, *shape):
        # torch's parameters_to_vector flattens each parameter (or gradient) by view(-1)
        # and concatenates them: of pieces, that is this rank's fragment of the vector,
        # whose length and norm are local, silently. FSDP2's DTensors concatenate to the
        # full vector; so do these, each by its full value (a collective: the function
        # runs on every rank over the same parameters). Every other view is the piece's.
        if sys._getframe(1).f_code is _PARAMETERS_TO_VECTOR and hasattr(self, "_face_full_tensor") \
                and _tracing_context() is None:
            return self._face_full_tensor().reshape(-1)
        return torch.Tensor.view(self, *shape)

    def __iter__(self):
        # torch iterates by unbind(0), which runs on the piece: another count of rows on
        # every rank than len() says.
        raise TypeError(
            f"iterating over a fully_shard {type(self).__name__}: its values are this rank's 1-D piece of a "
            f"parameter of shape {tuple(self._logical_shape())}; iterate over full_tensor() (a collective) "
            "or over the piece itself (.detach())")

    def _piece_rows(self) -> Tuple[int, Tuple[int, ...], bool]:
        """(first element of the piece in the parameter flattened row-major, the shape
        that flattening is of, whether the piece is all of it on every rank), for
        indexing by rows (piece_rows.py)."""
        raise NotImplementedError

    def __getitem__(self, index):
        # By the parameter's rows: on the piece, p[i] would be element i of every rank's
        # piece (torch's own nn.Embedding.reset_parameters writes weight[padding_idx] too).
        # Code being traced indexes the storage as it is.
        if _tracing_context() is not None:
            with DisableTorchFunctionSubclass():
                return torch.Tensor.__getitem__(self, index)
        return piece_rows.get_rows(self, *self._piece_rows(), index)

    def __setitem__(self, index, value) -> None:
        if _tracing_context() is not None:
            with DisableTorchFunctionSubclass():
                return torch.Tensor.__setitem__(self, index, value)
        piece_rows.set_rows(self, *self._piece_rows(), index, value)

    def _refuse_matmul(self, *args, **kwargs):
        # On the 1-D piece a product is of pieces: two pieces give a dot product, a piece
        # and a matrix a product of the wrong length; with some shapes nothing would fail.
        # Python asks a subclass's reflected method first, so `x @ p` comes here as well.
        # (Two sharded parameters multiply their full values: ShardedParameter.)
        raise RuntimeError(
            f"matrix product with a fully_shard {type(self).__name__} of shape {tuple(self._logical_shape())}: "
            "its values are this rank's 1-D piece of the parameter, so the product would be of pieces. Multiply "
            "full values: full_tensor() (a collective, on every rank); a product of two fully_shard parameters "
            "(`p @ q`) is of their full values")

    __matmul__ = __rmatmul__ = __imatmul__ = matmul = mm = _refuse_matmul

    @property
    def __cuda_array_interface__(self):
        # torch builds it from self.shape: it must describe the memory there is, the piece.
        with DisableTorchFunctionSubclass():
            piece = torch.Tensor.view(self, local_shape(self))
        return piece.__cuda_array_interface__

    def __repr__(self, *, tensor_contents=None) -> str:
        # torch's printing indexes by the reported shape: show the piece as what it is.
        with DisableTorchFunctionSubclass():
            piece = torch.Tensor.detach(self)
        return f"{type(self).__name__}(shape={tuple(self._logical_shape())}, this rank's piece={piece!r})"


def is_dtensor(t) -> bool:
    """A real DTensor: isinstance(t, DTensor), but not one of our parameters or gradients
    presenting themselves as one."""
    return isinstance(t, DTensor) and not isinstance(t, DTensorFace)


class DTensorFace:
    """The mixin behind the face (see the module docstring). A subclass provides
    `_face_active()`, `_face_layout()` (mesh, placements) and `_face_full_tensor()`."""

    __slots__ = ()

    def _face_active(self) -> bool:
        return True

    def _face_layout(self):
        raise NotImplementedError

    def _face_full_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def _face_asked_by(self, frame) -> bool:
        """Whether the code at `frame` sees a DTensor outside `_face_active()` too."""
        return False

    # isinstance() falls back to __class__ when type() does not match.
    @property
    def __class__(self):
        return DTensor if self._face_active() or self._face_asked_by(sys._getframe(1)) else type(self)

    @__class__.setter
    def __class__(self, cls) -> None:
        object.__dict__["__class__"].__set__(self, cls)

    @property
    def device_mesh(self):
        return self._face_layout()[0]

    @property
    def placements(self) -> tuple:
        return self._face_layout()[1]

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's flat piece (a view: in-place writes land in it)."""
        with DisableTorchFunctionSubclass():
            return torch.Tensor.view(self, local_shape(self))

    @property
    def _local_tensor(self) -> torch.Tensor:
        with DisableTorchFunctionSubclass():
            return torch.Tensor.detach(self)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The full value, on every rank of the unit's group (a collective: every rank
        calls it). Not differentiable."""
        return self._face_full_tensor()

    def redistribute(self, *args, **kwargs):
        raise NotImplementedError(
            f"redistribute() of a fully_shard {self._face_kind()}: it is this rank's flat piece of its unit's "
            "buffer, not a DTensor; use full_tensor() for its full value, or the module's state_dict() for "
            "FSDP2's DTensors")

    @property
    def _spec(self):
        raise AttributeError(
            f"a fully_shard {self._face_kind()} has no DTensorSpec: it is this rank's flat piece of its unit's "
            "buffer presenting itself as a DTensor (device_mesh, placements, to_local(), full_tensor()); "
            "the module's state_dict() gives FSDP2's DTensors")

    def _face_kind(self) -> str:
        return "tensor"
