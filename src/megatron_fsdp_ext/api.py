"""Public API: fully_shard, FSDPModule methods and the mixed-precision policy."""
from __future__ import annotations

import datetime
import functools
import math
import os
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import _C, backends, hf, shard_changes
from .hooks import FSDPState
from .param_index import iter_states
from .options import UnitOptions
from .strategy import sharding_strategy as strategy_named
from .state_dict import ModuleStateDictHooks

# The dtypes units store, gather and reduce in (csrc/dtypes.h: one definition).
_FLOAT_DTYPES = tuple(_C.supported_float_dtypes())

@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters, the gradient reduction and the outputs.

    param_dtype:  dtype parameters are all-gathered and computed in (None: as stored).
    reduce_dtype: dtype gradients are reduce-scattered in (None: param_dtype).
    output_dtype: dtype floating outputs of the module are cast to (None: unchanged).
    cast_forward_inputs: cast floating inputs to param_dtype before forward.
    The sharded master parameters always stay in their original dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                raise TypeError(f"MixedPrecisionPolicy.{field} must be a torch.dtype, got {value!r}")
            if value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field} must be a floating-point dtype "
                    f"(one of {', '.join(str(d) for d in _FLOAT_DTYPES)}), got {value}"
                )


class UnshardHandle:
    """Returned by FSDPModule.unshard(async_op=True); wait() makes the parameters usable."""

    def __init__(self, state: Optional[FSDPState]):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_unshard()
            self._state = None


class FSDPModule:
    """Mixin added to every module passed to fully_shard (the class is swapped in place)."""

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_mfsdp_state"]

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters; with async_op, return a handle to wait on."""
        state = self._fsdp_state
        state.lazy_init()
        state.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones again."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates gradients locally without communication
        (gradient accumulation); the next backward with True reduces everything."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync expects a bool, got {requires_gradient_sync!r}")
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        states = self._states(recurse)
        if reshard_after_forward:  # check every unit before changing any
            for state in states:
                if state.keeps_params_unsharded:
                    raise ValueError(
                        f"set_reshard_after_forward(True): {state} uses sharding_strategy="
                        f"{state.options.sharding_strategy!r}, which keeps parameters unsharded between uses")
        for state in states:
            if state.unit is not None or not reshard_after_forward:
                state.set_options(reshard_after_forward=reshard_after_forward)

    def start_param_sync(self) -> None:
        """With all_gather_in_start_param_sync=True (on this root): launch the first
        units' all-gathers now, typically right after optimizer.step(), so they overlap
        data loading; the next forward finds them in flight. Otherwise a no-op."""
        self._fsdp_state.start_param_sync()

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' parameters when this module's forward starts,
        instead of the next ones in the recorded forward order."""
        self._fsdp_state.forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' parameters when this module's backward starts,
        instead of the previous ones in the recorded forward order."""
        self._fsdp_state.backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def set_gather_bucket_bytes(self, nbytes: int) -> None:
        """(root) Consecutive units whose gathered parameters add up to at most `nbytes`
        are all-gathered by one coalesced collective (0: one per unit). Applies from the
        next forward, in the order recorded in the first iteration. Only the root's value
        is used: on another unit this raises (at once, or at the first forward)."""
        self._set_root_option("set_gather_bucket_bytes", gather_bucket_bytes=nbytes)

    def set_reduce_bucket_bytes(self, nbytes: int) -> None:
        """(root) Consecutive units whose packed gradients add up to at most `nbytes` are
        reduce-scattered by one coalesced collective (0: one per unit). Applies from the
        next backward, in the order recorded in the first iteration. Only the root's
        value is used: on another unit this raises (at once, or at the first forward)."""
        self._set_root_option("set_reduce_bucket_bytes", reduce_bucket_bytes=nbytes)

    def _set_root_option(self, setter: str, **change) -> None:
        state = self._fsdp_state
        if state.ctx is not None and not state.is_root:
            raise ValueError(f"{setter}: {state.label} is not the root of its model ({state.ctx.root.label}); only "
                             f"the root's setting is used, so call {setter} on the root")
        state.set_options(**change)
        state.root_setters_called.add(setter)  # checked at lazy init if this unit turns out not to be the root

    def set_prefetch_depth(self, depth: int) -> None:
        """How many units ahead to all-gather (0: no prefetch). Read by the root at its
        first forward; on the root after that, applies to its whole tree."""
        self._fsdp_state.set_options(prefetch_depth=depth)

    def _states(self, recurse: bool):
        return list(iter_states(self)) if recurse else [self._fsdp_state]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: every backward here ends by waiting for its
        reductions (the final callback), so each one behaves as FSDP2's last backward."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward expects a bool, got {is_last_backward!r}")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (fully_shard on a 2-D mesh): with False, backward still reduce-scatters
        inside the shard group but keeps the reduced shards in a partial sum instead of
        all-reducing them across replicas; the next backward with True all-reduces the
        sum once. For gradient accumulation across nodes: the cross-node traffic is paid
        once per step, not once per micro-batch. Without replication there is nothing to
        defer and this changes nothing (as in FSDP2)."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"set_requires_all_reduce expects a bool, got {requires_all_reduce!r}")
        for state in self._states(recurse):
            if state.unit is not None:
                state.unit.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's: with False, a unit keeps its gathered parameters after its backward
        (memory for less communication, e.g. across gradient-accumulation steps); the
        next use gathers again only if the optimizer changed the shards since."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"set_reshard_after_backward expects a bool, got {reshard_after_backward!r}")
        for state in self._states(recurse):
            state.set_options(reshard_after_backward=reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's: with False, this unit's parameters are not gathered for backward, for
        modules whose backward does not read them (e.g. an embedding: its weight gradient
        needs only the indices). A backward that does read them raises (torch refuses to
        unpack a saved weight onto the freed storage) instead of computing garbage."""
        if not isinstance(unshard_in_backward, bool):
            raise TypeError(f"set_unshard_in_backward expects a bool, got {unshard_in_backward!r}")
        self._fsdp_state.set_options(unshard_in_backward=unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's: this unit's reduced gradients are the sum over ranks divided by
        `factor` instead of the group size (the mean)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"set_gradient_divide_factor expects a finite number > 0, got {factor!r}")
        unit = self._fsdp_state.unit
        if unit is not None:
            unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of set_gradient_divide_factor."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's: use a SUM reduction in the collective. Ours always does (SUM, then one
        scale by 1/divide factor after it), so either value gives the same gradients."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms expects a bool, got {enable!r}")

    def set_post_optim_event(self, event) -> None:
        _unsupported("set_post_optim_event", "the optimizer step is tracked by a step hook; nothing to wait on")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        _unsupported("set_all_reduce_hook", "reduce gradients yourself after backward with "
                     "set_requires_gradient_sync(False), or use sharding_strategy='optim'")

    def set_custom_all_gather(self, comm) -> None:
        _unsupported("set_custom_all_gather", "pass all_gather_group= to fully_shard for a dedicated group")

    def set_custom_reduce_scatter(self, comm) -> None:
        _unsupported("set_custom_reduce_scatter", "pass reduce_scatter_group= to fully_shard for a dedicated group")

    def share_comm_ctx(self, modules) -> None:
        _unsupported("share_comm_ctx", "all units under one root already share streams and events")


def _unsupported(what: str, alternative: str):
    raise NotImplementedError(f"FSDPModule.{what} is not supported by megatron_fsdp_ext: {alternative}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` (e.g. Hugging Face's generate) gather the unit's
    parameters for the whole call and release them after, as forward() does; forward
    calls inside it find the unit gathered. torch's own register_fsdp_forward_method does
    nothing for our modules (it only knows FSDP2's class): use this one."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"register_fsdp_forward_method needs a fully_shard module, got {type(module).__name__}")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(f"{type(module).__name__} has no method {method_name!r}")
    if method_name == "forward":
        raise ValueError("forward is already driven by fully_shard's hooks")
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        if state.method_active:  # a registered method calling another one
            return method(*args, **kwargs)
        args, kwargs = state._pre_forward(module, args, kwargs)
        state.method_active = True
        try:
            output = method(*args, **kwargs)
        finally:
            state.method_active = False
        # No backward can follow an output without grad (generate runs under no_grad):
        # post-forward then releases the unit, as after a no_grad forward.
        needs_backward = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0])
        with torch.set_grad_enabled(needs_backward):
            return state._post_forward(module, args, output)

    module.__dict__[method_name] = wrapped


def attach_param_sync(optimizer: torch.optim.Optimizer, module: nn.Module):
    """Call module.start_param_sync() after every optimizer.step(). Returns the hook
    handle (remove() to detach)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"attach_param_sync needs a fully_shard module, got {type(module).__name__}")
    # Adopted first, so its post-hook marks the stepped units stale before this one
    # launches their gathers (post-hooks run in registration order).
    shard_changes.adopt(optimizer)
    return optimizer.register_step_post_hook(lambda opt, args, kwargs: module.start_param_sync())


def _states_of(modules, what: str):
    states = []
    for m in modules:
        state = m.__dict__.get("_mfsdp_state") if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(f"{what}: {type(m).__name__} is not a fully_shard module")
        states.append(state)
    return states


def _own_mp_policy(policy) -> MixedPrecisionPolicy:
    """Ours as is; torch's FSDP2 MixedPrecisionPolicy converted field by field."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                    output_dtype=policy.output_dtype,
                                    cast_forward_inputs=policy.cast_forward_inputs)
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (ours or torch.distributed.fsdp's), "
                    f"got {type(policy).__name__}")


def _groups_from_mesh(mesh, process_group):
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


def _mesh_covers_job(mesh) -> bool:
    """Whether `mesh.mesh` lists every rank of the job (not a slice of a larger mesh, where
    other ranks would see other rows and groups made from them would differ)."""
    return mesh.mesh.numel() == dist.get_world_size()


def _check_fsdp2_only_options(offload_policy, shard_placement_fn) -> None:
    if offload_policy is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if isinstance(offload_policy, CPUOffloadPolicy) or not isinstance(offload_policy, OffloadPolicy):
            raise NotImplementedError(
                f"offload_policy={offload_policy!r}: CPU offloading of parameters is not supported; "
                "pass None (or OffloadPolicy()) and keep parameters on the accelerator")
    if shard_placement_fn is not None:
        raise NotImplementedError(
            "shard_placement_fn is not supported: a unit shards its parameters as one flat buffer "
            "(contiguous ranges per rank), not parameter by parameter on a chosen dim")


# Second communicator per process group for all-gathers, created once and cached so
# that all-gather and reduce-scatter can run concurrently (NCCL serialises the
# collectives of one communicator). Groups with a bounded timeout (fully_shard(timeout=))
# are cached the same way, one per role: separate all-gather and reduce-scatter groups
# also make a rank that skipped backward wait in the other collective instead of
# pairing mismatched ones.
_GROUPS: dict = {}


def _group_for(pg, role: str, timeout: Optional[datetime.timedelta] = None, shard_groups=None):
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


def _check_timeout(timeout) -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    value = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout) if math.isfinite(timeout) else None
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta or number of seconds, got {value!r}")
    return timeout


_CLASS_CACHE: dict = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                 {"__module__": cls.__module__, **hf.overrides_for(cls)})
    return _CLASS_CACHE[cls]


def _check_devices(module: nn.Module, params: list, names: list, pg, mesh=None) -> Optional[torch.device]:
    """Checks that the parameters sit on one device the group's backend communicates; for
    meta parameters (deferred init) returns the device their shards are allocated on, as
    FSDP2 does: the mesh's device type; without a mesh the current CUDA device when CUDA
    is available and the backend communicates CUDA tensors, else the CPU."""
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
    if device.type == "meta":
        kind = mesh.device_type if mesh is not None else \
            "cuda" if "cuda" in kinds and torch.cuda.is_available() else "cpu"
        if kind not in kinds:
            raise ValueError(f"fully_shard({type(module).__name__}): meta parameters would be materialized on "
                             f"{kind}, which the process group's backend '{backends.backend_name(pg)}' does not "
                             f"communicate ({'/'.join(sorted(kinds))})")
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


def _collect(module: nn.Module, ignored: set):
    """The parameters this call owns and every slot (module._parameters, name) holding them.

    Subtrees of already-sharded modules belong to their own units and are skipped; a
    parameter of such a unit found outside it is a tie across units, which one unit's
    swap could not serve, so it is refused.
    """
    params, names, index_of = [], [], {}
    slots = []  # (params_dict, name, index)
    keys = []  # (state_dict key relative to `module`, index): every slot, tied ones included

    def visit(mod: nn.Module, prefix: str, is_top: bool):
        if not is_top and "_mfsdp_state" in mod.__dict__:
            return
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            # _mfsdp_owner marks both the sharded parameter and the original it replaced
            # (a tied original can still sit in a module outside the unit's subtree).
            owner = getattr(p, "_mfsdp_owner", None)
            if owner is not None:
                raise ValueError(
                    f"parameter '{prefix}{name}' already belongs to the fully_shard unit of "
                    f"{owner()!s}: either fully_shard was applied to an ancestor before this module "
                    "(call fully_shard bottom-up: inner modules first, then the root), or the parameter "
                    "is tied to a module of another unit (tied parameters must live in one unit)"
                )
            if id(p) not in index_of:
                index_of[id(p)] = len(params)
                params.append(p)
                names.append(prefix + name)
            slots.append((mod._parameters, name, index_of[id(p)]))
            keys.append((prefix + name, index_of[id(p)]))
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    visit(module, "", True)
    return params, names, slots, keys


def fully_shard(
    module: nn.Module,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    sharding_strategy: str = "optim_grads_params",
    reshard_after_forward: Optional[bool] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    alignment: int = _C.DEFAULT_ALIGNMENT,
    prefetch_depth: int = 1,
    gather_bucket_bytes: int = 0,
    reduce_bucket_bytes: int = 0,
    all_gather_group: Optional[dist.ProcessGroup] = None,
    reduce_scatter_group: Optional[dist.ProcessGroup] = None,
    create_all_gather_group: Optional[bool] = None,
    all_gather_in_start_param_sync: bool = False,
    overlap_grad_reduce: bool = True,
    check_for_nan_in_grad: bool = False,
    mesh=None,
    offload_policy=None,
    shard_placement_fn=None,
    timeout=None,
) -> nn.Module:
    """Shard `module`'s parameters (those not already claimed by an inner fully_shard
    call) across `process_group` and install the hooks that all-gather them for
    forward/backward and reduce their gradients.

    Call it bottom-up: each transformer block first, then the root. Returns `module`,
    whose class now also derives from FSDPModule. `module.parameters()` then yields
    this rank's shards (1-D), which is what the optimizer updates.

    Deferred init: a module built under torch.device("meta") is sharded without ever
    existing in full: each rank allocates only its shards, as FSDP2 does: on the mesh's
    device type, else on the current CUDA device when CUDA is available and the group's
    backend communicates CUDA tensors, else on the CPU. Then call
    megatron_fsdp_ext.materialize(model) (or
    load a checkpoint: load_full_state_dict, load_safetensors, load_checkpoint) before
    the first forward.

    process_group:   the group parameters are sharded over; gradients are
                     reduce-scattered on it (the reduce-scatter group). Any c10d
                     backend that communicates the parameters' device: NCCL, Gloo
                     (CPU or CUDA tensors, ranks sharing a GPU or not), torch's fake
                     backend (one process simulating rank r of W: nothing moves),
                     mixed ones ("cpu:gloo,cuda:nccl"); what a backend lacks is
                     replaced (megatron_fsdp_ext.backends, docs/design.md).
    sharding_strategy: "optim_grads_params" (ZeRO-3, default): params gathered per use
                     and freed after; "optim_grads" (ZeRO-2) and "optim" (ZeRO-1, full
                     all-reduced gradients): params stay unsharded between steps and
                     are gathered again only after the optimizer changed the shards;
                     "no_shard": everything replicated, gradients all-reduced, no
                     gather at all. Optimizer state is sharded except under no_shard.
    reshard_after_forward: free a unit's params after its forward and gather them
                     again for backward (default: True for optim_grads_params; the
                     other strategies keep them, and True is an error there).
    prefetch_depth:  units all-gathered ahead of use, in the forward order recorded in
                     the first iteration (0: off). The root's value governs its tree.
    gather_bucket_bytes: (root) consecutive units, in the recorded forward order, whose
                     gathered parameters add up to at most this many bytes are
                     all-gathered by one coalesced collective (one c10d call for many
                     small units), in forward and backward; prefetching then runs a
                     bucket ahead. 0 (default): one all-gather per unit.
    reduce_bucket_bytes: (root) the same for gradients: consecutive units whose packed
                     gradients (reduce dtype) add up to at most this many bytes are
                     reduce-scattered by one coalesced collective once the last of them
                     (the first in forward order) is done with backward; until then
                     their gradients wait unpacked. HSDP meshes and the full-gradient
                     strategies (no_shard, optim) reduce per unit. 0 (default): one
                     reduce-scatter per unit.
    all_gather_group: an explicit group (same ranks, same order) for all-gathers.
    reduce_scatter_group: an explicit group (same ranks, same order) for gradient
                     reductions (default: process_group), e.g. one per expert-parallel group.
    create_all_gather_group: give all-gathers their own communicator, created once per
                     group and cached, so they overlap reduce-scatters. Default: on where
                     collectives run on device streams and move data (NCCL), off
                     otherwise (Megatron-FSDP's `create_all_gather_group`).
    all_gather_in_start_param_sync: (root) let start_param_sync() launch the first
                     all-gathers right after the optimizer step; off: nothing is ever
                     launched outside forward/backward.
    check_for_nan_in_grad: (Megatron's) every reduced gradient shard of this unit is
                     checked for NaN/Inf by one fused kernel on the reduce-scatter
                     stream (no host synchronization); optimizer.step() (and
                     clip_grad_norm_) then refuses to run on them, on every rank,
                     raising NonFiniteGradientError naming the rank, unit and parameter.
                     The check's one host read happens at that step. Off by default.
    overlap_grad_reduce: False: backward waits for each unit's gradient reduction
                     before going on (no overlap; for debugging and measurements).
    mesh:            a DeviceMesh instead of process_group. 1-D: its group shards. 2-D
                     (replicate, shard), FSDP2's HSDP: parameters are sharded over
                     dim 1's group and replicated over dim 0's; gradients are
                     reduce-scattered in the shard group, then the shards all-reduced
                     across replicas (set_requires_all_reduce(False) defers that under
                     gradient accumulation). State dicts hold DTensors on this mesh.
    offload_policy:  FSDP2's; only None / OffloadPolicy() (no offload) is supported.
    shard_placement_fn: FSDP2's; not supported (units shard one flat buffer, not per parameter).
    timeout:         a datetime.timedelta (or seconds): every collective of this unit
                     fails after waiting this long, naming the unit and the phase,
                     instead of blocking for the process group's timeout (torch's
                     default is 30 minutes) when a rank stalls or desynchronizes. The
                     unit's collectives then run on groups created with this timeout
                     (cached; on NCCL that is one more communicator per role), so
                     `process_group` must span all ranks. None: the group's own timeout.
    mp_policy may also be torch.distributed.fsdp.MixedPrecisionPolicy (same fields).
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError(
            "fully_shard(list of modules): one unit spanning several sibling modules is not supported; "
            "call fully_shard on their common parent, or on each module separately")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard needs an initialized default process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment)"
        )
    if "_mfsdp_state" in module.__dict__:
        raise ValueError(f"fully_shard was already called on this {type(module).__name__} module")
    mp_policy = _own_mp_policy(mp_policy)
    process_group, replicate_group = _groups_from_mesh(mesh, process_group)
    _check_fsdp2_only_options(offload_policy, shard_placement_fn)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be a bool or None, got {reshard_after_forward!r} "
            "(FSDP2's int form, resharding to a smaller group after forward, is not supported)")
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    strategy = strategy_named(sharding_strategy)
    if reshard_after_forward is None:  # free after forward only where the strategy gathers per use
        reshard_after_forward = not strategy.keeps_unsharded
    # Checked here, before any work: contradictions (reshard_after_forward=True with a
    # strategy that keeps parameters unsharded), depth, flags.
    options = UnitOptions(
        sharding_strategy=sharding_strategy, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
        prefetch_depth=prefetch_depth, gather_bucket_bytes=gather_bucket_bytes,
        reduce_bucket_bytes=reduce_bucket_bytes,
        all_gather_in_start_param_sync=all_gather_in_start_param_sync,
        overlap_grad_reduce=overlap_grad_reduce, check_for_nan_in_grad=check_for_nan_in_grad,
    )
    for what, group in (("all_gather_group", all_gather_group), ("reduce_scatter_group", reduce_scatter_group)):
        if group is not None and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(pg):
            raise ValueError(
                f"{what} spans ranks {dist.get_process_group_ranks(group)} but the process group parameters are "
                f"sharded over spans {dist.get_process_group_ranks(pg)}; it must hold the same ranks in the same order"
            )
    if all_gather_group is not None and create_all_gather_group:
        raise ValueError("pass either all_gather_group or create_all_gather_group=True, not both")
    timeout = _check_timeout(timeout)
    if timeout is not None and (all_gather_group is not None or reduce_scatter_group is not None):
        raise ValueError("pass either timeout= or explicit all_gather_group/reduce_scatter_group, not both "
                         "(create your groups with torch.distributed.new_group(..., timeout=...) instead)")
    if timeout is not None and dist.get_world_size(pg) != dist.get_world_size() and \
            (replicate_group is None or not _mesh_covers_job(mesh)):
        raise ValueError("timeout= needs a process group spanning all ranks (new_group is collective over the "
                         "default group); for a subgroup, create groups with new_group(..., timeout=...) on every "
                         "rank and pass them as all_gather_group= and reduce_scatter_group=")
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError("ignored_params must be an iterable of parameters (e.g. [module.bias]), got a single tensor")
    ignored = {id(p) for p in (ignored_params or ())}
    params, names, slots, keys = _collect(module, ignored)
    unit = None
    sharded, unsharded = [], []
    deferred = False
    if params:
        materialize_on = _check_devices(module, params, names, pg, mesh)
        deferred = materialize_on is not None
        for p, n in zip(params, names):
            if p.dtype not in _FLOAT_DTYPES:
                kind = "unsupported floating" if p.is_floating_point() else "non-floating"
                raise ValueError(f"fully_shard: parameter '{n}' has {kind} dtype {p.dtype}; units hold "
                                 f"{', '.join(str(d) for d in _FLOAT_DTYPES)} parameters")
        unit = _C.Unit(
            [p.detach() for p in params], names, pg, alignment,
            mp_policy.param_dtype, mp_policy.reduce_dtype, strategy, materialize_on,
        )
        for p, sview, uview in zip(params, unit.sharded_views(), unit.unsharded_views()):
            s = nn.Parameter(sview, requires_grad=p.requires_grad)
            u = nn.Parameter(uview, requires_grad=p.requires_grad)
            # Keep user/Megatron attributes (e.g. tensor-parallel markers) on both.
            for k, v in p.__dict__.items():
                if not k.startswith("_mfsdp"):
                    setattr(s, k, v)
                    setattr(u, k, v)
            sharded.append(s)
            unsharded.append(u)
        unit.bind_params(sharded, unsharded)
        # Debug mode (like TORCH_DISTRIBUTED_DEBUG): ranks compare (unit, phase, size)
        # before every collective; see Unit::set_check_collectives.
        unit.check_collectives = os.environ.get("MFSDP_CHECK_COLLECTIVES", "0") == "1"
        unit.check_nonfinite = check_for_nan_in_grad
        # HSDP: the mesh's shard groups, one per replica, so that groups made for one
        # can be made for all (new_group is collective over the job).
        shard_groups = (mesh.mesh.reshape(-1, mesh.size(1)).tolist()
                        if replicate_group is not None and _mesh_covers_job(mesh) else None)
        if timeout is not None and dist.get_world_size(pg) > 1:
            reduce_scatter_group = _group_for(pg, "reduce_scatter", timeout, shard_groups)
            if strategy.gathers:
                all_gather_group = _group_for(pg, "all_gather", timeout, shard_groups)
        if timeout is not None and replicate_group is not None and shard_groups is not None:
            replicate_groups = mesh.mesh.reshape(-1, mesh.size(1)).t().tolist()
            replicate_group = _group_for(replicate_group, "replicate", timeout, replicate_groups)
        if all_gather_group is None:
            # new_group() is collective over the default group, so only a group spanning
            # the whole job gets one automatically; per-rank subgroups (expert-parallel,
            # ...) must pass all_gather_group explicitly.
            spans_job = dist.get_world_size(pg) == dist.get_world_size() or shard_groups is not None
            if create_all_gather_group is None:
                create_all_gather_group = backends.overlaps_collectives(pg, unit.device) and spans_job
            if not strategy.gathers:
                create_all_gather_group = False
            if create_all_gather_group and dist.get_world_size(pg) > 1:
                if not spans_job:
                    raise ValueError(
                        "create_all_gather_group=True needs a process group spanning all ranks "
                        "(new_group is collective over the default group); for a subgroup, create the "
                        "all-gather group on every rank yourself and pass all_gather_group="
                    )
                all_gather_group = _group_for(pg, "all_gather", shard_groups=shard_groups)
        if replicate_group is not None:
            unit.set_replicate_group(replicate_group)
        if all_gather_group is not None:
            unit.set_all_gather_group(all_gather_group)
        if reduce_scatter_group is not None:
            unit.set_reduce_scatter_group(reduce_scatter_group)

    state = FSDPState(module, unit, names, sharded, unsharded, slots, pg, options, check_group=reduce_scatter_group,
                      deferred=deferred, device_mesh=mesh if mesh is not None and mesh.ndim == 2 else None)
    owner = weakref.ref(state)
    for p in params:  # a tied copy of an original elsewhere must not be claimed again
        p._mfsdp_owner = owner
        p._mfsdp_replaced = True  # an optimizer still holding it is refused at its first step
    module.__dict__["_mfsdp_state"] = state
    state.state_dict_hooks = ModuleStateDictHooks(state, keys)
    module.__class__ = _fsdp_class(type(module))
    shard_changes.ensure_step_hook_registered()
    return module
