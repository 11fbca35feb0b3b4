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

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.distributed.tensor import DTensor, Shard


class FlatShard(Shard):
    """The placement of a sharded parameter on its data-parallel shard dim. For torch's
    DTensor code it is `Shard(dim)`: the rows FSDP2 gives each rank, which is how state
    dicts and torch.distributed.checkpoint place this parameter's values. The parameter's
    live local tensor (`to_local()`) is this rank's flat piece of its unit's buffer."""

    def __repr__(self) -> str:
        return f"FlatShard(dim={self.dim})"

    def __str__(self) -> str:
        return f"FS({self.dim})"


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

    # isinstance() falls back to __class__ when type() does not match.
    @property
    def __class__(self):
        return DTensor if self._face_active() else type(self)

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
            return torch.Tensor.view(self, self.shape)

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
