"""Sharded gradients that torch's own norm code reduces across ranks.

A unit's `.grad`s are this rank's pieces of flattened parameters (plain 1-D tensors, views
of one flat buffer). torch's `clip_grad_norm_` / `get_total_norm` and torchtitan's clip
compute `torch._foreach_norm` of the gradients, stack the norms and take their
`vector_norm`: on plain pieces that is each rank's local norm. FSDP2 gets the global norm
because its gradients are DTensors: the norms come out Partial and are reduced when used.

Here the gradients keep their plain storage but carry a Python subclass, `ShardedGrad`,
one per reduction domain (the process groups the pieces are split over: the unit's shard
group, and the tensor-parallel group for TP-sharded parameters). Its __torch_function__
intercepts only the norm path:
- `_foreach_norm` / `vector_norm` of sharded gradients return `PartialNorm`s (local norms
  tagged with their domain and order);
- `torch.stack` of norms keeps each element's domain (`PartialNormVector`);
- `vector_norm` of such a vector reduces each domain's p-th power sum (max for inf) over
  its groups and returns a plain tensor: the global norm, the same on every rank;
- any other use of a `PartialNorm` first reduces it to its global value (as DTensor
  redistributes Partial to Replicate).
- `torch._amp_foreach_non_finite_check_and_unscale_` (torch.amp.GradScaler) reduces its
  found_inf over the gradients' domains, so every rank skips a step alike.
- `g.detach()` and `g.data` are the same piece and keep its type (a DTensor's stay
  DTensors), so norms of them are global too.
- elementwise ops (`g ** 2`, `g.abs()`, `g * p`, `torch.isfinite(g)`, casts) keep the
  type: the result is a piece laid out as the gradient, as DTensor arithmetic stays Shard;
  so do copies and new tensors of the piece (`g.clone()`, `torch.zeros_like(g)`): a copy
  kept to compare with a later gradient, or an accumulation buffer, reduces globally too;
- whole-tensor reductions of such a piece (`sum`, `mean`, `amax`/`max()`, `amin`/`min()`,
  `all`, `any`, `count_nonzero`, `prod`) return a `PartialStat`, reduced over the domain
  when used (as DTensor's Partial); `std`/`var` reduce at once. Along a dim of a parameter
  of 2 or more dims they are refused: the piece is 1-D.
Every other op on a gradient runs as on a plain tensor (the subclass disabled, plain
outputs): optimizers, `_foreach_mul_` of the clip. A plain tensor of the
piece's shape assigned as a parameter's gradient (`p.grad = p.grad / 2`) takes the
ShardedGrad type (ShardedParameter.__setattr__), so a clip after it is still global.

Replicated gradients (no_shard) carry a ShardedGrad type without a domain: every rank
holds the whole value, so their local norm is already global.

Every ShardedGrad also presents itself as a DTensor, as FSDP2's gradients are
(dtensor_face.py): `isinstance(g, DTensor)`, `g.device_mesh` / `g.placements` (its
parameter's), `g.full_tensor()`. torchtitan's expert-parallel clip asks exactly that.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C import DisableTorchFunctionSubclass
from torch.utils import _foreach_utils

from . import state_dict
from .dtensor_face import DTensorFace, LogicalShape, local_numel, local_shape


class ReductionDomain:
    """The process groups a gradient piece is split over, and the device their
    collectives take (offloaded units keep host gradients that NCCL cannot reduce)."""

    def __init__(self, groups: Tuple[dist.ProcessGroup, ...], device: torch.device):
        self.groups = groups
        self.device = torch.device(device)
        self.ranks = tuple(tuple(dist.get_process_group_ranks(g)) for g in groups)

    @property
    def sort_key(self):
        """The order domains are reduced in, the same on every rank: by their groups' shape
        (sizes and rank strides), which every rank of a mesh dim sees alike, never by the
        ranks themselves. Two domains of two ranks over the same ranks (HSDP's shard group
        and MoE's expert-parallel group) would otherwise be taken in opposite orders on
        ranks 0 and 1, each waiting in a different group. Domains of one shape keep the
        order they appear in (parameter order: the same everywhere)."""
        return (tuple(len(r) for r in self.ranks), tuple(tuple(x - r[0] for x in r) for r in self.ranks))

    def __repr__(self) -> str:
        return f"ReductionDomain(ranks={self.ranks}, device={self.device})"


class ShardedGrad(LogicalShape, torch.Tensor, DTensorFace):
    """A gradient piece of a sharded parameter (see the module docstring). Subclasses,
    one per ReductionDomain, DTensor layout and parameter shape, carry them as `domain`
    (None: replicated), `layout` (mesh, placements) and `face_shape` (what shape queries
    answer: LogicalShape); `owners` are weak references to the unit states whose
    gradients take the class (for full_tensor())."""

    domain: Optional[ReductionDomain] = None
    layout: tuple = (None, ())
    face_shape: torch.Size = torch.Size()
    owners: list = []

    def _logical_shape(self) -> torch.Size:
        return type(self).face_shape

    def __reduce_ex__(self, protocol):
        # Pickles as what it holds: this rank's piece, a plain tensor.
        with DisableTorchFunctionSubclass():
            return torch.Tensor.detach(self).__reduce_ex__(protocol)

    def _face_layout(self):
        return type(self).layout

    def _holder(self, same_memory: bool):
        """(unit state, parameter index) of the parameter whose gradient this piece is, or
        (None, -1). `same_memory`: also a view of it (its .data / .detach(): the same
        memory and class, so the same shape: empty pieces that share an address are of one
        shape, and every rank decides by that shape alike)."""
        with DisableTorchFunctionSubclass():
            ptr, n = torch.Tensor.data_ptr(self), torch.Tensor.numel(self)
            for ref in type(self).owners:
                state = ref()
                if state is None or state.unit is None:
                    continue
                for i, p in enumerate(state.unit.sharded_params):
                    g = p.grad
                    if g is self or (same_memory and type(g) is type(self) and torch.Tensor.data_ptr(g) == ptr
                                     and torch.Tensor.numel(g) == n):
                        return state, i
        return None, -1

    def _face_full_tensor(self) -> torch.Tensor:
        state, i = self._holder(same_memory=False)
        if state is None:
            raise RuntimeError("full_tensor() of a gradient no sharded parameter holds any more (after the "
                               "optimizer step, a gradient is a plain tensor again)")
        return state_dict.full_grad(state, i)

    def _face_kind(self) -> str:
        return "gradient"

    def _piece_rows(self):
        from .sharded_param import piece_rows_of

        state, i = self._holder(same_memory=True)
        if state is None:
            raise RuntimeError("indexing a gradient piece no sharded parameter holds any more (after the optimizer "
                               "step a gradient is a plain tensor again): its rows cannot be told")
        return piece_rows_of(state, i)

    def __deepcopy__(self, memo):
        # A copy of this rank's piece that still reduces its norm across ranks (torch's
        # default goes through new_empty, which is plain here, and refuses).
        with DisableTorchFunctionSubclass():
            out = torch.Tensor.clone(self).as_subclass(type(self))
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RESHAPES or func in _JOINS:
            kept = _flatten_or_join(func, args, kwargs)
            if kept is not None:
                return kept
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _KEEPS_GRAD and isinstance(args[0], ShardedGrad):
            # g.detach(), g.data: the same piece, still a sharded gradient to the norms
            # (FSDP2's DTensor stays a DTensor), so norms of it stay global (MAE's and
            # BEiT's `torch.norm(torch.stack([torch.norm(p.grad.detach()) ...]))`).
            return torch.Tensor.as_subclass(_plain_call(func, args, kwargs), type(args[0]))
        _refuse_full_shape_meeting_piece(func, args)
        if func in _ELEMENTWISE:
            return _elementwise(func, args, kwargs)
        reduction = _REDUCTIONS.get(func)
        if reduction is not None and isinstance(args[0], ShardedGrad):
            return _reduce_piece(func, reduction, args, kwargs)
        return _plain_call(func, args, kwargs)


def _split(g: "ShardedGrad") -> bool:
    """Whether the gradient's pieces differ between ranks (not replicated, not a group of one)."""
    domain = type(g).domain
    return domain is not None and any(len(ranks) > 1 for ranks in domain.ranks)


def _one_dim_target(func, args, kwargs) -> bool:
    """Whether a flatten / ravel, or a view / reshape to a 1-D shape (`view(-1)`,
    `reshape(n)`), not a dtype view."""
    if func in (torch.Tensor.flatten, torch.flatten, torch.Tensor.ravel, torch.ravel):
        return True
    shape = args[1:] or (kwargs.get("shape", kwargs.get("size")),)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return len(shape) == 1 and isinstance(shape[0], (int, torch.SymInt))


def _flatten_or_join(func, args, kwargs):
    """Flattening a gradient, or joining gradients (`torch.cat([p.grad.view(-1) for p in
    params])`, the flat-gradient vector of PCGrad and gradient-similarity code), would give
    this rank's fragment: its length, dot products and norm local and different on every
    rank, silently (FSDP2's DTensors stay sharded and reduce when read). Refused by name on
    every rank where the pieces are split. A 1-D gradient's flattening is the gradient
    itself: it keeps its type (norms of it stay global). None: not such a call."""
    if func in _JOINS:
        tensors = args[0] if args else kwargs.get("tensors", ())
        split = [t for t in tensors if isinstance(t, ShardedGrad) and _split(t)]
        what = f"torch.{func.__name__} of fully_shard gradients"
    else:
        g = args[0] if args else None
        if not (isinstance(g, ShardedGrad) and _one_dim_target(func, args, kwargs)):
            return None
        if len(type(g).face_shape) <= 1:
            with DisableTorchFunctionSubclass():
                return torch.Tensor.as_subclass(func(*args, **kwargs), type(g))
        split = [g] if _split(g) else []
        what = f"flattening a fully_shard gradient ({func.__name__})"
    if not split:
        return None
    raise RuntimeError(
        f"megatron_fsdp_ext: {what} of shape {tuple(type(split[0]).face_shape)} would be of this rank's 1-D piece "
        "(its length and values differ between ranks), not of the whole gradient. For the full vector use "
        "torch.nn.utils.parameters_to_vector([p.grad for p in params]) (a collective, on every rank; write a "
        "vector back with p.grad = vec[i:i + n].view(p.shape)) or g.full_tensor(); norms and sums of the "
        "gradients themselves are global")


def _refuse_full_shape_meeting_piece(func, args) -> None:
    """A tensor built from a gradient's reported shape (`torch.zeros(p.grad.shape)`,
    `p.grad.full_tensor()`) meeting the gradient itself pairs the whole parameter with
    this rank's piece: mostly a size error, but silently wrong where broadcasting fits one
    to the other (a piece as long as the trailing dims, or of one element). Refused by
    name whenever the two meet, for parameters of 2 or more dims: a piece is always 1-D, so
    a tensor shaped like the piece never takes that shape, and every rank refuses alike
    (pieces differ in size, some are empty). For a 1-D parameter a tensor of its shape
    cannot be told from one of a piece that happens to be the whole parameter on this rank:
    not checked. Optimizers never pay for this: their step untags the gradients first."""
    for g in args:
        if not isinstance(g, ShardedGrad):
            continue
        face = type(g).face_shape
        if len(face) < 2:
            continue
        for other in args:
            if isinstance(other, torch.Tensor) and not isinstance(other, ShardedGrad) and local_shape(other) == face:
                raise RuntimeError(
                    f"megatron_fsdp_ext: {getattr(func, '__name__', func)} combines a tensor of shape {tuple(face)} "
                    f"with a fully_shard gradient that reports that shape but holds this rank's 1-D piece "
                    f"({local_numel(g)} elements here). Build tensors for a gradient from the gradient itself "
                    f"(torch.zeros_like(g), g.clone()), or work on g.full_tensor() alone")


class _NormValue(torch.Tensor):
    """A local norm of sharded gradients, or a vector of them: reduced only by
    `vector_norm`; moved or cast it stays what it is; reading what it is needs no
    reduction; any other use reduces it to its global value first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _SHOWN:
            if args[0]._is_partial():
                return _show_partial(func, *args, **kwargs)
            with DisableTorchFunctionSubclass():  # a global value already: shown as a plain tensor
                return func(torch.Tensor.as_subclass(args[0], torch.Tensor), *args[1:], **kwargs)
        if func in _METADATA:
            return _plain_call(func, args, kwargs)
        if func in _KEEPS_NORM:  # .to(device), .float(), ...: the same local norm elsewhere
            return args[0]._same_kind(_plain_call(func, args, kwargs))
        args, kwargs = _resolve_partials((args, kwargs))
        return _plain_call(func, args, kwargs)


def _show_partial(func, value: "_NormValue", spec: str = "", **_) -> str:
    """repr / str / format of a norm not yet reduced: shown with what it is (FSDP2's
    partial DTensor shows its placement), never as if it were the global value. Showing
    does not reduce: a print on one rank alone would otherwise wait for the others."""
    with DisableTorchFunctionSubclass():
        local = torch.Tensor.as_subclass(value, torch.Tensor)
    if func is torch.Tensor.__format__ and spec:
        raise TypeError(
            f"format '{spec}' of a norm of fully_shard gradients that is this rank's part only: call .item() "
            "(or float()) on every rank first, which reduces it to the global norm (FSDP2's partial DTensor "
            "refuses a format spec too)")
    return f"{type(value).__name__}(local={local.tolist()}; this rank's part, .item() on every rank gives the global norm)"


class PartialNorm(_NormValue):
    """A local norm (0-dim) of sharded gradients: `domain` and `ord` say how it combines
    (domain None: a replicated gradient's norm, the same global value on every rank)."""

    domain: Optional[ReductionDomain] = None
    ord: float = 2.0

    def _is_partial(self) -> bool:
        return type(self).domain is not None

    def _same_kind(self, out: torch.Tensor) -> torch.Tensor:
        out.__class__ = type(self)
        return out


class PartialNormVector(_NormValue):
    """torch.stack of norms: element i is a local norm of `keys[i]` (domain, ord), or a
    plain (global) value where keys[i] is None."""

    def _is_partial(self) -> bool:
        return any(k is not None for k in self._mfsdp_keys)

    def _same_kind(self, out: torch.Tensor) -> torch.Tensor:
        out.__class__ = PartialNormVector
        out._mfsdp_keys = self._mfsdp_keys
        return out


def _plain_call(func, args, kwargs):
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


_GRAD_CLASSES: Dict[tuple, type] = {}
_NORM_CLASSES: Dict[tuple, type] = {}


_DOMAINS: Dict[tuple, ReductionDomain] = {}


def grad_class(groups: Sequence[dist.ProcessGroup], device, layout: tuple = (None, ()),
               shape: Sequence[int] = ()) -> type:
    """The ShardedGrad subclass of the domain split over `groups` (in this order; none:
    replicated) whose collectives run on `device`, presenting `layout` (mesh, placements)
    as a DTensor and `shape` as its shape; one class per domain, layout and shape, created once."""
    domain_key = (tuple(groups), str(torch.device(device)))
    shape = torch.Size(shape)
    key = domain_key + (layout, shape)
    cls = _GRAD_CLASSES.get(key)
    if cls is None:
        domain = None
        if groups:
            domain = _DOMAINS.get(domain_key)
            if domain is None:
                domain = _DOMAINS[domain_key] = ReductionDomain(tuple(groups), device)
        cls = type("ShardedGrad", (ShardedGrad,), {"domain": domain, "layout": layout, "face_shape": shape,
                                                   "owners": [], "__module__": __name__})
        _GRAD_CLASSES[key] = cls
        # torch's clip and get_total_norm take their foreach path only for tensor types
        # registered here (DTensor registers itself the same way).
        if cls not in _foreach_utils._foreach_supported_types:
            _foreach_utils._foreach_supported_types.append(cls)
    return cls


def _norm_class(domain: ReductionDomain, ord: float) -> type:
    key = (id(domain), ord)
    cls = _NORM_CLASSES.get(key)
    if cls is None:
        cls = type("PartialNorm", (PartialNorm,), {"domain": domain, "ord": ord, "__module__": __name__})
        _NORM_CLASSES[key] = cls
    return cls


def _as_partial(norm: torch.Tensor, grad: torch.Tensor, ord: float) -> torch.Tensor:
    """The norm of a gradient piece, marked as what it is: a local norm of its domain, or
    (a replicated gradient: domain None) a norm already global."""
    if isinstance(grad, ShardedGrad):
        norm.__class__ = _norm_class(type(grad).domain, ord)
    return norm


def _refuse_mixed(kind: str) -> None:
    raise RuntimeError(
        f"megatron_fsdp_ext: {kind} mixes fully_shard gradients with plain tensors (e.g. the gradients of "
        "ignored_params, or of parameters outside the sharded model). Each rank holds its own plain "
        "gradient, so no norm over both is the same global value on every rank. Take the norm of (or clip) "
        "the two sets separately; FSDP2 refuses this too ('mixed torch.Tensor and DTensor')")


# torch's CPU norm of one long vector keeps one running fp32 sum: it comes out about 4e-5
# low at 1M elements, 2e-4 at 4M, 5e-3 at 64M (GPU reductions are trees; CPU norms along a
# dim sum each row on its own). Up to _CPU_NORM_EXACT_UP_TO elements a piece's norm is
# torch's, as FSDP2's and one plain process's are (their CPU results agree within 1e-5);
# a longer piece (CPU-offloaded units hold a unit's whole shard) is taken over rows of
# _CPU_NORM_ROW elements, the rows' norms combined the same way: about 1e-7, and faster.
_CPU_NORM_ROW = 1 << 12
_CPU_NORM_EXACT_UP_TO = 1 << 20


def _cpu_norm(x: torch.Tensor, ord, dtype) -> torch.Tensor:
    x = x.reshape(-1)
    n = x.numel()
    if n <= _CPU_NORM_ROW:
        return torch.linalg.vector_norm(x, ord, dtype=dtype)
    whole = n // _CPU_NORM_ROW * _CPU_NORM_ROW
    rows = torch.linalg.vector_norm(x[:whole].view(-1, _CPU_NORM_ROW), ord, dim=1, dtype=dtype)
    if whole < n:
        rows = torch.cat([rows, torch.linalg.vector_norm(x[whole:], ord, dtype=dtype).reshape(1)])
    return _cpu_norm(rows, ord, None)


def _local_norms(pieces, ord, dtype):
    """torch._foreach_norm of non-empty plain pieces (see _CPU_NORM_EXACT_UP_TO)."""
    ord_f = float(ord)
    rowwise = ord_f > 0 and math.isfinite(ord_f)
    long = {i for i, p in enumerate(pieces)
            if rowwise and p.device.type == "cpu" and local_numel(p) > _CPU_NORM_EXACT_UP_TO}
    if not long:
        return list(torch._foreach_norm(pieces, ord, dtype=dtype))
    short = [i for i in range(len(pieces)) if i not in long]
    norms = dict(zip(short, torch._foreach_norm([pieces[i] for i in short], ord, dtype=dtype) if short else []))
    for i in long:
        norms[i] = _cpu_norm(pieces[i], ord, dtype)
    return [norms[i] for i in range(len(pieces))]


def _foreach_norm(tensors, ord=2, dtype=None):
    tensors = list(tensors)
    if not all(isinstance(t, ShardedGrad) for t in tensors):
        _refuse_mixed("torch._foreach_norm")
    ord_f = float(ord)
    with DisableTorchFunctionSubclass():
        # An empty piece (a rank holding none of a parameter) adds nothing (empty_piece_norm);
        # torch refuses the inf-norm of an empty tensor.
        live = [i for i, t in enumerate(tensors) if local_numel(t) > 0]
        norms = _local_norms([tensors[i] for i in live], ord, dtype) if live else []
        out = []
        by_index = dict(zip(live, norms))
        for i, t in enumerate(tensors):
            n = by_index.get(i)
            if n is None:
                n = empty_piece_norm(ord_f, dtype or t.dtype, t.device)
            out.append(n)
    return tuple(_as_partial(n, t, ord_f) for n, t in zip(out, tensors))


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    ord_f = float(ord)
    whole = dim is None and out is None
    if ord_f == 0 and isinstance(x, (PartialNormVector, PartialNorm)):
        # ord 0 of norms counts the entries that are nonzero: each entry's global value
        # first (a sum of the pieces' counts), not one count over every piece.
        args, kwargs = _resolve_partials(((x, ord, dim, keepdim), {"dtype": dtype, "out": out}))
        return _plain_call(torch.linalg.vector_norm, args, kwargs)
    if isinstance(x, PartialNormVector) and whole:
        return _reduce_vector(x, ord_f, dtype)
    if isinstance(x, PartialNorm) and whole and x._is_partial():
        return _reduce_vector(_stack([x]), ord_f, dtype)
    if isinstance(x, ShardedGrad) and whole:
        with DisableTorchFunctionSubclass():
            n = (_local_norms([x], ord, dtype)[0] if local_numel(x) > 0
                 else empty_piece_norm(ord_f, dtype or x.dtype, x.device))
        return _as_partial(n, x, ord_f)
    args, kwargs = _resolve_partials(((x, ord, dim, keepdim), {"dtype": dtype, "out": out}))
    return _plain_call(torch.linalg.vector_norm, args, kwargs)


def _stack(tensors, dim=0, *, out=None):
    tensors = _resolve_stats(list(tensors))
    with DisableTorchFunctionSubclass():
        scalars = all(torch._C.TensorBase.dim(t) == 0 for t in tensors)
    if out is not None or dim != 0 or not scalars:
        args, kwargs = _resolve_partials(((tensors, dim), {"out": out}))
        return _plain_call(torch.stack, args, kwargs)
    # A replicated gradient's norm (domain None) is global already: key None, as a plain value.
    keys = [(type(t).domain, type(t).ord) if isinstance(t, PartialNorm) and t._is_partial() else None for t in tensors]
    if any(k is not None for k in keys) and not all(isinstance(t, _NormValue) for t in tensors):
        _refuse_mixed("torch.stack of gradient norms")
    with DisableTorchFunctionSubclass():
        stacked = torch.stack(tensors)
    if all(k is None for k in keys):
        return stacked
    stacked.__class__ = PartialNormVector
    stacked._mfsdp_keys = keys
    return stacked


def _reduce_vector(x: "PartialNormVector", ord: float, dtype=None) -> torch.Tensor:
    """The global `ord`-norm of a vector of local norms: per domain, the local sum of
    |n|^ord (max for inf) reduced over the domain's groups, then combined."""
    keys = x._mfsdp_keys
    with DisableTorchFunctionSubclass():
        values = torch.Tensor.as_subclass(x, torch.Tensor)
        if dtype is not None:
            values = values.to(dtype)
        work_dtype = values.dtype if values.dtype in (torch.float32, torch.float64) else torch.float32
        by_domain: Dict[int, list] = {}
        domains: Dict[int, ReductionDomain] = {}
        plain = []
        for i, key in enumerate(keys):
            if key is not None and key[1] != ord:
                raise ValueError(f"vector_norm(ord={ord}) of gradient norms taken with ord={key[1]}: "
                                 "the norms of sharded gradients combine only under the order they were taken with")
            if key is None:
                plain.append(i)
            else:
                by_domain.setdefault(id(key[0]), []).append(i)
                domains[id(key[0])] = key[0]

        def local(idx, device):
            return local_power_sum(values[idx].to(device=device, dtype=work_dtype), ord)

        total = local(plain, values.device)
        for did in sorted(domains, key=lambda d: domains[d].sort_key):
            domain = domains[did]
            part = local(by_domain[did], domain.device)
            for group in domain.groups:
                part = all_reduce_power_sum(part, ord, group)
            total = combine_power_sums(total, part.to(values.device), ord)
        return norm_of_power_sum(total, ord).to(values.dtype)


# How local norms of order `ord` combine into the global one. The "power sum" is what
# adds up across pieces: the sum of |n|^ord, the count of nonzeros for ord 0, the max for
# inf and the min for -inf. Shared by grad_norm's norms and tools.clip.

def empty_piece_norm(ord: float, dtype, device) -> torch.Tensor:
    """The local norm of an empty piece: one that adds nothing to the power sum (inf for
    negative orders, whose |n|^ord of nothing is 0, and the identity of the -inf min)."""
    return torch.full((), math.inf if ord < 0 else 0.0, dtype=dtype, device=device)


def local_power_sum(norms: torch.Tensor, ord: float) -> torch.Tensor:
    """The power sum of a 1-D tensor of norms (possibly empty)."""
    norms = norms.abs()
    if ord == math.inf:
        return norms.max() if norms.numel() else norms.new_zeros(())
    if ord == -math.inf:
        return norms.min() if norms.numel() else norms.new_full((), math.inf)
    if ord == 0:
        return norms.sum()
    return (norms ** ord).sum()


def all_reduce_power_sum(part: torch.Tensor, ord: float, group) -> torch.Tensor:
    """`part` combined over `group`. A max or min carries a NaN flag beside the value:
    backends' MAX/MIN need not pass on a NaN from another rank (Gloo's drops it), and a
    non-finite norm must read the same on every rank."""
    if not math.isinf(ord):
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        return part
    sign = 1.0 if ord > 0 else -1.0  # a min is the max of the negated values
    value = torch.nan_to_num(part * sign, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    both = torch.stack([value, torch.isnan(part).to(part.dtype)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return torch.where(both[1] > 0, torch.full_like(both[0], math.nan), both[0] * sign)


def combine_power_sums(a: torch.Tensor, b: torch.Tensor, ord: float) -> torch.Tensor:
    if ord == math.inf:
        return torch.maximum(a, b)  # propagates NaN
    if ord == -math.inf:
        return torch.minimum(a, b)
    return a + b


def norm_of_power_sum(total: torch.Tensor, ord: float) -> torch.Tensor:
    return total if math.isinf(ord) or ord == 0 else total ** (1.0 / ord)


def _resolve_partials(tree):
    """`tree` with every PartialNorm / PartialNormVector replaced by its global value."""
    from torch.utils._pytree import tree_map

    def resolve(t):
        if isinstance(t, PartialStat):
            return _resolve_stats([t])[0]
        if isinstance(t, PartialNorm):
            return _reduce_vector(_stack([t]), type(t).ord) if t._is_partial() else \
                torch.Tensor.as_subclass(t, torch.Tensor)
        if isinstance(t, PartialNormVector):
            return _resolve_vector_elements(t)
        return t
    return tree_map(resolve, tree)


def _resolve_vector_elements(x: "PartialNormVector") -> torch.Tensor:
    """Each element of a vector of local norms replaced by its own global norm."""
    with DisableTorchFunctionSubclass():
        values = torch.Tensor.as_subclass(x, torch.Tensor).clone()
    for i, key in enumerate(x._mfsdp_keys):
        if key is not None:
            one = values[i:i + 1].clone()
            one.__class__ = PartialNormVector
            one._mfsdp_keys = [key]
            with DisableTorchFunctionSubclass():
                values[i] = _reduce_vector(one, key[1])
    return values


def _tensor_norm(input, p="fro", dim=None, keepdim=False, dtype=None, out=None):
    """Tensor.norm / torch.norm of a gradient piece: over the whole gradient, the same
    global norm as vector_norm's; along a dim, of this rank's piece (as vector_norm)."""
    if dim is None and out is None and (p is None or p == "fro" or isinstance(p, (int, float))):
        return _vector_norm(input, 2 if p in (None, "fro") else p, dtype=dtype)
    args, kwargs = _resolve_partials(((input, p, dim, keepdim), {"dtype": dtype, "out": out}))
    return _plain_call(torch.norm, args, kwargs)


def _amp_unscale(grads, found_inf, inv_scale):
    """torch.amp.GradScaler's check: unscale this rank's pieces, then take found_inf's max
    over every reduction domain of the gradients (as DTensor does for FSDP2's Partial
    found_inf). Each rank sees infs in its own pieces only: without it a rank whose piece
    holds the inf skips the step and halves its scale while the others step (the shards
    drift apart, silently)."""
    grads = list(grads)
    with DisableTorchFunctionSubclass():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    domains = []
    for g in grads:
        domain = type(g).domain if isinstance(g, ShardedGrad) else None
        if domain is not None and all(d is not domain for d in domains):
            domains.append(domain)
    for domain in sorted(domains, key=lambda d: d.sort_key):  # stable: parameter order within a shape
        flag = found_inf.to(domain.device)
        for group in domain.groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        found_inf.copy_(flag)


# Reductions of a gradient besides its norm. A gradient piece is elements [a, b) of the
# parameter flattened, so an elementwise op of it (with numbers, 0-dim tensors or tensors
# of the piece's own shape: the parameter's piece, another gradient laid out alike) is
# the same elements of the op's full result, and a whole-tensor reduction of that is this
# rank's share of the full reduction. FSDP2's DTensor gradients give the global value
# (Partial, reduced when used); on plain pieces `(g ** 2).sum()`, `g.abs().max()` or
# `torch.isfinite(g).all()` were each rank's own, silently: a rank-local NaN check makes
# the ranks take different branches.

class PartialStat(_NormValue):
    """A whole-tensor reduction (0-dim) of this rank's piece: `kind` ("sum", "max", "min",
    "prod") says how the pieces' values combine over `domain`; `divisor` divides the
    combined value (a mean: the parameter's number of elements)."""

    domain: Optional[ReductionDomain] = None
    kind: str = "sum"
    divisor: int = 1

    def _is_partial(self) -> bool:
        return True

    def _same_kind(self, out: torch.Tensor) -> torch.Tensor:
        out.__class__ = type(self)
        return out


_STAT_CLASSES: Dict[tuple, type] = {}


def _stat_class(domain: ReductionDomain, kind: str, divisor: int) -> type:
    key = (id(domain), kind, divisor)
    cls = _STAT_CLASSES.get(key)
    if cls is None:
        cls = type("PartialStat", (PartialStat,), {"domain": domain, "kind": kind, "divisor": divisor,
                                                   "__module__": __name__})
        _STAT_CLASSES[key] = cls
    return cls


def _elementwise(func, args, kwargs):
    """An elementwise op with a gradient piece among its operands: a piece of the same
    layout (the first piece's ShardedGrad type) when every other tensor operand is 0-dim
    or of the piece's shape; a plain result otherwise (broadcast against something else)."""
    operands = list(args) + list(kwargs.values())
    first = None
    for t in operands:
        if isinstance(t, ShardedGrad):
            if first is None:
                first = t
            elif type(t).domain is not type(first).domain:
                raise RuntimeError(
                    f"megatron_fsdp_ext: {getattr(func, '__name__', func)} combines fully_shard gradients split over "
                    f"different process groups ({type(first).domain} and {type(t).domain}): their pieces hold "
                    "different elements. Combine their full_tensor()s, or reduce each on its own")
    out = _plain_call(func, args, kwargs)
    if first is None or not isinstance(out, torch.Tensor):
        return out
    shape = local_shape(first)
    for t in operands:
        if isinstance(t, torch.Tensor) and not isinstance(t, ShardedGrad) and t.dim() != 0 \
                and local_shape(t) != shape:
            return out
    if local_shape(out) != shape:
        return out
    return torch.Tensor.as_subclass(out, type(first))


def _identity(kind: str, dtype: torch.dtype, device) -> torch.Tensor:
    """What an empty piece adds to a combination of `kind` (torch refuses max/min of nothing)."""
    if kind == "max":
        value = -math.inf if dtype.is_floating_point else (False if dtype == torch.bool else torch.iinfo(dtype).min)
    elif kind == "min":
        value = math.inf if dtype.is_floating_point else (True if dtype == torch.bool else torch.iinfo(dtype).max)
    else:
        value = 1 if kind == "prod" else 0
    return torch.full((), value, dtype=dtype, device=device)


def _reduce_over(value: torch.Tensor, kind: str, domain: ReductionDomain) -> torch.Tensor:
    """`value` (this rank's share) combined over every group of `domain`."""
    dtype, device = value.dtype, value.device
    part = value.to(domain.device)
    if kind in ("max", "min") and part.dtype.is_floating_point:
        ord = math.inf if kind == "max" else -math.inf  # NaN-aware max / min
        for group in domain.groups:
            part = all_reduce_power_sum(part, ord, group)
        return part.to(device=device, dtype=dtype)
    if part.dtype == torch.bool:
        part = part.to(torch.int32)
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
          "prod": dist.ReduceOp.PRODUCT}[kind]
    part = part.clone()
    for group in domain.groups:
        dist.all_reduce(part, op=op, group=group)
    return part.to(device=device, dtype=dtype)


def _resolve_stats(tensors: list) -> list:
    """`tensors` with their PartialStats reduced: one all-reduce per domain and kind for
    the whole list (`torch.stack([g.pow(2).sum() for g in grads])`), in the list's order
    of first appearance, the same on every rank."""
    groups: Dict[tuple, list] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, PartialStat):
            groups.setdefault((id(type(t).domain), type(t).kind, t.dtype), []).append(i)
    if not groups:
        return tensors
    out = list(tensors)
    with DisableTorchFunctionSubclass():
        for idx in groups.values():
            cls = type(tensors[idx[0]])
            local = torch.stack([torch.Tensor.as_subclass(tensors[i], torch.Tensor) for i in idx])
            total = _reduce_over(local, cls.kind, cls.domain)
            for j, i in enumerate(idx):
                divisor = type(tensors[i]).divisor
                out[i] = total[j] / divisor if divisor != 1 else total[j]
    return out


def _dim_of(args, kwargs):
    """The dim argument of a reduction call, or None (max/min with a tensor second argument
    are the elementwise maximum/minimum: not a dim)."""
    dim = kwargs.get("dim")
    if dim is None and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
        dim = args[1]
    return dim


def _reduce_piece(func, reduction, args, kwargs):
    x, kind = args[0], reduction
    cls = type(x)
    name = getattr(func, "__name__", str(func))
    if kind in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _elementwise(func, args, kwargs)  # torch.max(a, b): elementwise
    dim = _dim_of(args, kwargs)
    face = cls.face_shape
    if dim is not None:
        dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        whole = len(face) <= 1 and all(d in (0, -1) for d in dims) and not kwargs.get("keepdim", False) \
            and (len(args) < 3 or args[2] is False) and kind in ("sum", "mean", "var", "std", "all", "any", "prod",
                                                               "amax", "amin", "count")
        if not whole:
            raise NotImplementedError(
                f"megatron_fsdp_ext: {name}(dim={dim}) of a fully_shard gradient of shape {tuple(face)}: this rank "
                "holds a 1-D piece of the parameter flattened, not its rows or columns. Reduce the whole gradient "
                "(no dim: the global value, as of FSDP2's DTensor), or take g.full_tensor() first (a collective)")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("dim", "keepdim")}
        args = args[:1]
    if cls.domain is None:  # a replicated gradient: the piece is the whole of it
        return _plain_call(func, args, kwargs)
    if kind in ("var", "std"):
        return _variance(x, kwargs, kind == "std")
    with DisableTorchFunctionSubclass():
        piece = torch.Tensor.as_subclass(x, torch.Tensor)
        if kind == "mean":
            local = torch.sum(piece, dtype=kwargs.get("dtype"))
            if not local.dtype.is_floating_point:
                raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be floating point, "
                                   f"got {piece.dtype}")
            kind, divisor = "sum", math.prod(face)
        elif kind == "count":
            local, kind, divisor = torch.count_nonzero(piece), "sum", 1
        else:
            divisor, empty_refused = 1, kind in ("max", "min", "amax", "amin")
            kind = _COMBINED_BY[kind]
            local = func(piece, *args[1:], **kwargs) if piece.numel() or not empty_refused \
                else _identity(kind, piece.dtype, piece.device)
    local.__class__ = _stat_class(cls.domain, kind, divisor)
    return local


def _variance(x, kwargs, std: bool) -> torch.Tensor:
    """var / std of the whole gradient, reduced at once (two all-reduces): the global mean,
    then the global sum of squared deviations from it."""
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1 if kwargs.get("unbiased", True) else 0
    domain, n = type(x).domain, math.prod(type(x).face_shape)
    with DisableTorchFunctionSubclass():
        piece = torch.Tensor.as_subclass(x, torch.Tensor)
        work = piece if piece.dtype in (torch.float32, torch.float64) else piece.float()
        mean = _reduce_over(work.sum(), "sum", domain) / n
        squares = _reduce_over(((work - mean) ** 2).sum(), "sum", domain)
        var = squares / max(n - correction, 0) if n - correction > 0 else squares * math.nan
        out = var.sqrt() if std else var
        return out.to(piece.dtype)


# How a kind of reduction's per-rank values combine.
_COMBINED_BY = {"sum": "sum", "prod": "prod", "amax": "max", "max": "max", "any": "max", "amin": "min", "min": "min",
                "all": "min"}
_REDUCTIONS = {}
for _fn, _kind in (("sum", "sum"), ("nansum", "sum"), ("mean", "mean"), ("amax", "amax"), ("amin", "amin"),
                   ("max", "max"), ("min", "min"), ("all", "all"), ("any", "any"), ("prod", "prod"),
                   ("count_nonzero", "count"), ("var", "var"), ("std", "std")):
    for _owner in (torch.Tensor, torch):
        if hasattr(_owner, _fn):
            _REDUCTIONS[getattr(_owner, _fn)] = _kind

_ELEMENTWISE = set()
for _fn in ("abs", "neg", "negative", "pow", "square", "sqrt", "rsqrt", "exp", "log", "log2", "log10", "log1p",
            "sign", "sgn", "add", "sub", "mul", "div", "true_divide", "clamp", "clip", "isfinite", "isnan", "isinf",
            "isposinf", "isneginf", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt", "le", "gt", "ge",
            "nan_to_num", "maximum", "minimum", "reciprocal", "float", "double", "half", "bfloat16", "to",
            "type_as",
            # Copies and new tensors laid out as the piece (DTensor's stay DTensors): a copy
            # kept to compare with a later gradient, an accumulation buffer.
            "clone", "contiguous", "zeros_like", "ones_like", "empty_like", "full_like"):
    for _owner in (torch.Tensor, torch):
        if hasattr(_owner, _fn):
            _ELEMENTWISE.add(getattr(_owner, _fn))
for _fn in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
            "__pow__", "__rpow__", "__neg__", "__abs__", "__invert__", "__and__", "__or__", "__eq__", "__ne__",
            "__lt__", "__le__", "__gt__", "__ge__"):
    _ELEMENTWISE.add(getattr(torch.Tensor, _fn))


_HANDLERS = {
    torch._amp_foreach_non_finite_check_and_unscale_: _amp_unscale,
    torch.Tensor.norm: _tensor_norm,
    torch.norm: _tensor_norm,
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch.stack: _stack,
}
# Reading what a tensor is, not its values: never a reason to reduce a partial norm.
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.data_ptr,
             torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
             torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__len__,
             torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.shape.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__,
             torch.Tensor.is_cuda.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.is_leaf.__get__}
_SHOWN = {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__str__}
_KEEPS_NORM = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.double, torch.Tensor.detach,
               torch.Tensor.cpu, torch.Tensor.cuda}
# Views of a gradient that are the gradient's piece itself: they keep its ShardedGrad type.
_KEEPS_GRAD = {torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__}
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
             torch.Tensor.ravel, torch.ravel}
_JOINS = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack, torch.dstack,
          torch.column_stack, torch.row_stack}


def unit_grad_types(state) -> list:
    """Per parameter of the unit of `state`, the ShardedGrad type of its gradient pieces:
    split over the unit's shard group unless the strategy replicates gradients, and over
    the tp group for a tensor-parallel-sharded parameter (no domain where the piece is the
    whole gradient), presenting the parameter's DTensor layout."""
    unit, tp = state.unit, state.tp
    dp = () if unit.strategy.replicated else (state.process_group,)
    types = []
    for i in range(len(unit.sharded_params)):
        groups = dp
        spec = tp.specs.get(i) if tp is not None else None
        if spec is not None and spec.sharded:
            groups = dp + (tp.tp_group,)
        types.append(grad_class(groups, unit.device, state_dict.face_layout(state, i), state_dict.face_shape(state, i)))
    for cls in set(types):
        cls.owners[:] = [ref for ref in cls.owners if ref() is not None and ref() is not state] + [weakref.ref(state)]
    return types
