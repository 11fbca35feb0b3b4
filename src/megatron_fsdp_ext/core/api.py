"""Public API: fully_shard (construction: construct.py) and the FSDPModule methods."""
from __future__ import annotations

import functools
import sys
import weakref
from collections import OrderedDict
from typing import Iterable, List, Optional, Tuple, Union

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

from .. import _C
from . import fsdp2_view, in_place_init, shard_changes
from .comm_buffers import apply_comm_buffer_source
from .construct import (CommGroups, check_devices, offload_pinning, check_target, collect_params,
                        groups_from_mesh, make_unit, placement_groups, post_forward_size_of)
from .extension_points import class_overrides, outer_sharding
from .hook_support import load_dynamo
from .hooks import FSDPState, unit_kind
from .link import LinkModel
from .options import MixedPrecisionPolicy, UnitOptions, as_mp_policy
from .param_index import iter_states, live_states
from .retype import UnitRecipe, move_units, retype_units
from .sharded_param import ShardedParameter, is_to_empty_function, outermost_converted
from .state_dict import ModuleStateDictHooks, callers_arrived, keep_load_pre_hooks_last
from .strategy import sharding_strategy as strategy_named


class UnshardHandle(torch_fsdp.UnshardHandle):
    """Returned by FSDPModule.unshard(async_op=True); wait() makes the parameters usable.
    An instance of torch's UnshardHandle, as FSDP2's handles are."""

    def __init__(self, state: Optional[FSDPState]):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            for s in self._state.with_companions:
                s.wait_unshard()
            self._state = None


# Set while an outermost FSDPModule._apply runs, whose check covered the modules below it.
_APPLY_CHECKED = False


def _original_class(cls: type) -> type:
    """The user's class behind a class fully_shard made: the first class of the MRO after
    torch's FSDPModule."""
    mro = cls.__mro__
    return mro[mro.index(torch_fsdp.FSDPModule) + 1]


class FSDPModule(torch_fsdp.FSDPModule):
    """Mixin added to every module passed to fully_shard (the class is swapped in place).

    It derives from torch's FSDPModule, so torch's and torchtitan's `isinstance(m,
    FSDPModule)` checks treat our modules as FSDP2's, and it overrides every method torch's
    FSDPModule defines: each does what FSDP2's does on our units, or raises naming the
    method (docs/design.md lists torch's and torchtitan's checks and what each does here).
    `fully_shard.state(module)` returns a view of our unit for torch's pipelining
    (fsdp2_view.py)."""

    def __new__(cls, *args, **kwargs):
        # Indexing a container (nn.Sequential[1:]) calls type(self)(...): build the
        # original class, not a module without a unit (as FSDP2 does).
        orig = _original_class(cls)
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        # The copy would share the unit (its flat buffers, its group) with the original, or
        # (built through __new__) have none: neither trains as a model of its own.
        raise TypeError(
            f"copy.deepcopy of a fully_shard module ({type(self).__name__}) is not supported: its parameters "
            "are pieces of a unit bound to a process group. Copy the model before fully_shard and shard the "
            "copy too (e.g. for torch.optim.swa_utils.AveragedModel, or an EMA model)")

    @property
    def _fsdp_state(self) -> FSDPState:
        return self.__dict__["_mfsdp_state"]

    def _get_fsdp_state(self):
        """What torch's code reads as FSDP2's state: a view of our unit (fsdp2_view.py)."""
        return self._fsdp_state.fsdp2_view

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """nn.Module's, after every rank of each unit group met has called it too (a
        collective: state_dict.callers_arrived); checked once per group for the outermost
        call, which the destination dict passed down the module tree identifies."""
        if args:  # torch's deprecated positional form: passed on as it is
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        callers_arrived(self._states(False), "state_dict()", destination)
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Our load pre-hooks go last on every owner, behind hooks registered after
        # fully_shard: here, as load_state_dict reaches this module before the owners below
        # it. (torch's FSDPModule does not define it: super() is the module's own.)
        keep_load_pre_hooks_last(self._states(False))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's, after waiting for the units' overlapped optimizer updates
        (CPUAdamW(overlap_step=True)), which still read the gradients it would zero. What
        the units accumulated with sync off (not in any .grad yet) is dropped too, as plain
        PyTorch drops it from .grad: a micro-batch discarded before the synced one."""
        for state in self._states(True):
            if state.unit is not None:
                state.unit.wait_host_update()
                state.unit.drop_unreduced_grads()
        super().zero_grad(set_to_none=set_to_none)

    def _apply(self, fn, recurse: bool = True):
        # Not torch's FSDPModule._apply (it reshards FSDP2's parameter groups): the module's
        # own, once the units below have taken a new device or dtype (retype.py) or refused the
        # change (done once, at the outermost call: nn.Module._apply calls this again for
        # every fully_shard module below).
        global _APPLY_CHECKED
        if _APPLY_CHECKED:
            return super(torch_fsdp.FSDPModule, self)._apply(fn, recurse)
        states = self._states(recurse)
        empty = is_to_empty_function(fn)
        moved = not empty and move_units(
            states, fn, lambda: frozenset(map(id, outermost_converted(self).modules() if recurse else [self])))
        # A device change: the units' shards moved already (or stay: offloaded units' live
        # in host memory, with their gradients); buffers and other gradients get fn's.
        kept = frozenset(id(p.grad) for s in states if moved and s.unit is not None and s.unit.offloaded
                         for p in s.unit.sharded_params if p.grad is not None)
        retype_units(states, fn)
        # nn.Module.to_empty, on this module or on one around it (Lightning's Trainer runs it
        # on the LightningModule): FSDP2's way in from the meta device (build on meta,
        # fully_shard, to_empty, then initialize in place, as torchtitan's Trainer does). The
        # shards already live on the device and stay (fresh storage for them would be a
        # second copy of every shard until the first forward adopted it); buffers and other
        # parameters get fn's. The units then count as materialized with uninitialized
        # memory, and random fills of their parameters until their first forward draw whole
        # parameters, as one plain process does, each rank keeping its slice (in_place_init.py).
        _APPLY_CHECKED = True
        # torch.__future__.set_swap_module_params_on_conversion(True) makes nn.Module._apply
        # swap every parameter with a new one (swap_tensors): the units converted theirs in
        # place above, and a sharded parameter is its unit's (optimizers hold the object), so
        # the conversion below assigns `.data` as without the flag. Tensor subclasses that fn
        # returns are still swapped (torch decides that by the result).
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(False)
        try:
            out = super(torch_fsdp.FSDPModule, self)._apply(
                (lambda t: t if isinstance(t, ShardedParameter) or id(t) in kept else fn(t))
                if empty or moved else fn, recurse)
        finally:
            _APPLY_CHECKED = False
            torch.__future__.set_swap_module_params_on_conversion(swap)
        if empty:
            in_place_init.begin(states, uninitialized=True)
        return out

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters; with async_op, return a handle to wait on."""
        state = self._fsdp_state
        state.lazy_init()
        for s in state.with_companions:
            s.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones again."""
        for s in self._fsdp_state.with_companions:
            s.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates gradients locally without communication
        (gradient accumulation); the next backward with True reduces everything."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync expects a bool, got {requires_gradient_sync!r}")
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        states = self._states(recurse)
        if reshard_after_forward:  # check every unit before changing any
            for state in states:
                if state.keeps_params_unsharded:
                    raise ValueError(
                        f"set_reshard_after_forward(True): {state} uses sharding_strategy="
                        f"{state.options.sharding_strategy!r}, which keeps parameters unsharded between uses")
        for state in states:  # as FSDP2's setter: a bool replaces an int given to fully_shard
            if state.unit is not None or not reshard_after_forward:
                state.set_options(reshard_after_forward=reshard_after_forward, post_forward_shard_size=0)

    def start_param_sync(self) -> None:
        """With all_gather_in_start_param_sync=True (on this root): launch the first
        units' all-gathers now, typically right after optimizer.step(), so they overlap
        data loading; the next forward finds them in flight. Otherwise a no-op."""
        self._fsdp_state.start_param_sync()

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' parameters when this module's forward starts,
        instead of the next ones in the recorded forward order."""
        targets = _states_of(modules, "set_modules_to_forward_prefetch")
        for s in self._fsdp_state.with_companions:
            s.forward_prefetch = targets

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """All-gather these FSDP modules' parameters when this module's backward starts,
        instead of the previous ones in the recorded forward order."""
        targets = _states_of(modules, "set_modules_to_backward_prefetch")
        for s in self._fsdp_state.with_companions:
            s.backward_prefetch = targets

    def set_gather_bucket_bytes(self, nbytes: Union[int, str]) -> None:
        """(root) Consecutive units whose gathered parameters add up to at most `nbytes`
        are all-gathered by one coalesced collective (0: one per unit; "auto": from the
        measured link, see fully_shard). Applies from the
        next forward, in the order recorded in the first iteration. Only the root's value
        is used: on another unit this raises (at once, or at the first forward)."""
        self._set_root_option("set_gather_bucket_bytes", gather_bucket_bytes=nbytes)

    def bucket_budgets(self) -> Tuple[int, int]:
        """(root) The gather and reduce bucket budgets in effect, in bytes: the options'
        values with "auto" resolved (0 until the first backward measured the link)."""
        state = self._fsdp_state
        if state.ctx is None:
            return (0, 0)
        schedule = state.ctx.schedule
        return schedule.budget("gather_bucket_bytes"), schedule.budget("reduce_bucket_bytes")

    def set_reduce_bucket_bytes(self, nbytes: Union[int, str]) -> None:
        """(root) Consecutive units whose packed gradients add up to at most `nbytes` are
        reduce-scattered by one coalesced collective (0: one per unit; "auto": from the
        measured link, see fully_shard). Applies from the
        next backward, in the order recorded in the first iteration. Only the root's
        value is used: on another unit this raises (at once, or at the first forward)."""
        self._set_root_option("set_reduce_bucket_bytes", reduce_bucket_bytes=nbytes)

    def set_link_model(self, link_model: Optional[LinkModel]) -> None:
        """(root) Plan the "auto" bucket budgets from `link_model` (megatron_fsdp_ext.link.LinkModel:
        alpha seconds, all-gather bytes per second) instead of timing the link after the first
        backward; None: time it. For a model measured once and reused (no probe at start-up,
        the same plan every run), and for sizing under torch's fake backend, where nothing
        moves and "auto" would otherwise plan no buckets. Takes effect at the end of the
        next backward if the budgets were not resolved yet."""
        self._set_root_option("set_link_model", link_model=link_model)

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
        """This module's unit states (its own and its companions on other meshes), and with
        `recurse` those of every FSDP module below it."""
        return list(iter_states(self)) if recurse else self._fsdp_state.with_companions

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
        for s in self._fsdp_state.with_companions:
            s.set_options(unshard_in_backward=unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's: this unit's reduced gradients are the sum over ranks divided by
        `factor` instead of the group size (the mean); on every mesh of the unit (MoE:
        the experts' too), as FSDP2 sets every parameter group of the module."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"set_gradient_divide_factor expects a finite number > 0, got {factor!r}")
        for s in self._fsdp_state.with_companions:
            if s.unit is not None:
                s.unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of set_gradient_divide_factor."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's: use a SUM reduction in the collective. Ours always does (SUM, then one
        scale by 1/divide factor after it), so either value gives the same gradients."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms expects a bool, got {enable!r}")

    def reset_iter_state(self) -> None:
        """FSDP2's: after an exception aborted a forward or backward, reset the root's
        per-iteration state (call on the root): in-flight reductions are waited for,
        gradients still on unsharded parameters dropped, every unit resharded. Gradients
        already reduced stay (zero_grad clears them)."""
        state = self._fsdp_state
        if state.ctx is None:
            return
        if not state.is_root:
            raise RuntimeError(f"reset_iter_state must be called on the root FSDP module ({state.ctx.root.label}), "
                               f"not on {state.label}")
        state.ctx.abandon_backward()
        for s in state.ctx.states:
            s._group_pending.clear()
            s.reshard()

    def no_sync(self):
        """Megatron's and DDP's gradient-accumulation context: backward inside it
        accumulates gradients locally (set_requires_gradient_sync(False) on this module's
        units), and the next backward outside it, or finish_grad_sync(), reduces them."""
        return _no_sync(self)

    def finish_grad_sync(self) -> None:
        """Megatron's: reduce now whatever the units under this module accumulated without
        sync (after the last micro-batch of a pipeline schedule, with sync switched back
        on) and wait; every .grad is complete when it returns. Gradients already reduced
        by a synced backward are left as they are."""
        state = self._fsdp_state
        if state.ctx is None:
            return
        for s in self._states(True):
            s.requires_gradient_sync = True
        state.ctx.finish_gradient_sync()

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2's: whether parameters without a gradient join the reduction as zeros. Our
        units always reduce the whole flat buffer (zeros where a parameter got no
        gradient), so the collectives never mismatch across ranks; either value works."""
        if not isinstance(reduce_scatter_unused_params, bool):
            raise TypeError(f"set_reduce_scatter_unused_params expects a bool, got {reduce_scatter_unused_params!r}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers expects an int >= 1, got {max_input_buffers!r}")
        if max_input_buffers != 1:
            _unsupported("set_reduce_scatter_max_input_buffers",
                         "one reduction stays in flight (retired before the next allocates); only 1 is supported")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        _unsupported("set_separate_reduce_scatter_group",
                     "all-gathers get their own communicator instead: fully_shard(create_all_gather_group=True), "
                     "the default where collectives run on device streams (NCCL)")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's: this unit's all-gather output and reduce-scatter input are allocated by
        its process group's backend instead of torch's caching allocator. NCCL allocates
        them with ncclMemAlloc and registers them with the communicator, so its all-gather
        runs on them in place (on fewer channels, hence fewer SMs); the memory is the
        group's own pool, reused by communication buffers only. A group's buffers come from
        it once the group has run a collective on the device; a buffer already allocated
        moves at its next gather. Where the backend cannot allocate (Gloo, a device without
        NVLink multicast) the caching allocator stays, with a warning. No collective."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_allocate_memory_from_process_group_for_comm expects a bool, got {enable!r}")
        for s in self._fsdp_state.with_companions:
            s.set_options(comm_buffers_from_group=enable)
            if s.ctx is not None:
                apply_comm_buffer_source(s)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2's (torchtitan's `enable_fsdp_symm_mem`): collectives on memory NCCL can
        reach in place. Ours takes the unit's all-gather output and reduce-scatter input
        from the group's NCCL-registered pool, as
        set_allocate_memory_from_process_group_for_comm(True) does, instead of
        symmetric-memory windows: both are zero-copy for NCCL, and the values are the same
        (benchmarks/RESULTS.md tables 16 and 22 measure both). Warns that it substitutes."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend 'NCCL' only (as FSDP2's), got {backend!r}")
        warnings.warn(
            "set_symm_mem_for_comm: megatron_fsdp_ext takes the all-gather output and reduce-scatter input "
            "from the process group's NCCL-registered pool (set_allocate_memory_from_process_group_for_comm"
            "(True)) instead of symmetric-memory windows; the values computed are the same", stacklevel=2)
        self.set_allocate_memory_from_process_group_for_comm(True)

    def _set_unshard_async_op(self, async_op: bool):
        _unsupported("_set_unshard_async_op", "gathers always run on the all-gather stream")

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


@contextlib.contextmanager
def _no_sync(module: "FSDPModule"):
    states = module._states(True)
    previous = [s.requires_gradient_sync for s in states]
    for s in states:
        s.requires_gradient_sync = False
    try:
        yield
    finally:
        for s, p in zip(states, previous):
            s.requires_gradient_sync = p


def _unsupported(what: str, alternative: str):
    raise NotImplementedError(f"FSDPModule.{what} is not supported by megatron_fsdp_ext: {alternative}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` (e.g. Hugging Face's generate) gather the unit's
    parameters for the whole call and release them after, as forward() does; forward
    calls inside it find the unit gathered. torch's own register_fsdp_forward_method
    does the same on our modules (through fsdp2_view); this one also resets the unit if
    the method raises."""
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
        outermost = not state.method_active
        args, kwargs = state.enter_method(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            if outermost:
                state.method_active = False
            raise
        return state.exit_method(module, args, output, outermost)

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
        states.extend(state.with_companions)
    return states


_CLASS_CACHE: dict = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                 {"__module__": cls.__module__, **class_overrides(cls)})
    return _CLASS_CACHE[cls]


def _group_state(modules, params, names, slots, keys, group, comm: CommGroups, options: UnitOptions, *,
                 alignment: int, mp_policy, strategy, offload_pin, check_for_nan_in_grad: bool) -> FSDPState:
    """The unit of one placement group of a fully_shard call (its parameters, the module
    slots and state-dict keys that hold them) on `comm`'s groups, and its FSDPState, whose
    hooks on `modules` gather, release and reduce it."""
    index = {old: new for new, old in enumerate(group.indices)}
    group_params = [params[i] for i in group.indices]
    group_names = [names[i] for i in group.indices]
    group_slots = [(d, name, index[i]) for d, name, i in slots if i in index]
    group_keys = [[(key, index[i]) for key, i in module_keys if i in index] for module_keys in keys]
    unit, deferred, tp = None, False, None
    if group_params:
        materialize_on = check_devices(modules[0], group_params, group_names, comm.pg, comm.mesh,
                                       offload=offload_pin is not None)
        deferred = group_params[0].is_meta
        tp = outer_sharding().collect(group_params, group_names, comm.mesh)
        unit = make_unit(group_params, group_names, comm.pg, alignment, mp_policy, strategy, materialize_on,
                         check_for_nan_in_grad, tp, offload_pin, label=unit_kind(modules))
        if group.dims is not None:
            unit.set_state_dict_dims(group.dims)
        comm.connect(unit, strategy, options.post_forward_shard_size)
    mesh = comm.mesh
    state = FSDPState(modules, unit, group_names, group_slots, comm.pg, options,
                      check_group=comm.reduce_scatter_group,
                      deferred=deferred, device_mesh=mesh if mesh is not None and mesh.ndim == 2 else None, tp=tp,
                      collective_timeout=comm.timeout)
    if mesh is not None and mesh.ndim == 1 and \
            dist.get_process_group_ranks(mesh.get_group()) == dist.get_process_group_ranks(comm.pg):
        state.shard_mesh = mesh
    if group.mesh is not None:
        state.mesh_tag = "+".join(group.mesh.mesh_dim_names or ("other mesh",))
    owner = weakref.ref(state)
    for p in group_params:  # a tied copy of an original elsewhere must not be claimed again
        p._mfsdp_owner = owner
        p._mfsdp_replaced = True  # an optimizer still holding it is refused at its first step
    if unit is not None:
        state.recipe = UnitRecipe(comm.pg, alignment, mp_policy, strategy, check_for_nan_in_grad, comm, group.dims)
    state.fsdp2_view = fsdp2_view.Fsdp2StateView(state)
    for m, module_keys in zip(modules, group_keys):
        ModuleStateDictHooks(state, m, module_keys)
    return state


# Callers whose next steps read FSDP2's DTensor parameters themselves (their local rows, and
# `isinstance(p.data, DTensor)` to find what FSDP left replicated), which our parameters,
# one flat piece each, are not: refused by name before anything is sharded, rather than
# failing later with a shape mismatch or, where pieces happen to be of one size on every
# rank, broadcasting rank 0's piece over the others.
_FSDP2_PARAMETER_READERS = {
    "transformers.distributed.fsdp": (
        "transformers' from_pretrained(distributed_config=...) loads each rank's rows of FSDP2's DTensor "
        "parameters into the parameters themselves, and its Trainer then broadcasts every parameter whose .data "
        "is not a DTensor. Load the model with from_pretrained() without distributed_config, then call "
        "fully_shard on its decoder layers and on the model (README: Hugging Face); the Trainer's "
        "fsdp='full_shard' (Accelerate's FSDP2 path) works with ours"),
}


def _refuse_fsdp2_parameter_readers() -> None:
    # The whole stack: a script may reach ours through its own wrapper.
    frame = sys._getframe(2)
    while frame is not None:
        caller = frame.f_globals.get("__name__")
        why = _FSDP2_PARAMETER_READERS.get(caller)
        if why is not None:
            raise NotImplementedError(f"fully_shard called from {caller}: {why}")
        frame = frame.f_back


def fully_shard(
    module: Union[nn.Module, List[nn.Module]],
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    sharding_strategy: str = "optim_grads_params",
    reshard_after_forward: Union[bool, int, None] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    alignment: int = _C.DEFAULT_ALIGNMENT,
    prefetch_depth: int = 1,
    gather_bucket_bytes: Union[int, str] = "auto",
    reduce_bucket_bytes: Union[int, str] = "auto",
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
    dp_mesh_dims=None,
) -> nn.Module:
    """Shard `module`'s parameters (those not already claimed by an inner fully_shard
    call) across `process_group` and install the hooks that all-gather them for
    forward/backward and reduce their gradients.

    Call it bottom-up: each transformer block first, then the root. Returns `module`,
    whose class now also derives from FSDPModule. A list of modules (FSDP2's, e.g.
    torchtitan's [model.norm, model.output]) makes one unit of them all: gathered before
    the first of them runs in a forward, released after the last; their parent must be
    sharded too (a unit of several modules is never the root). `module.parameters()` then yields
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
                     other strategies keep them, and True is an error there). An int
                     N (FSDP2's), a factor of the shard group's size: after forward
                     each rank keeps 1/N of the gathered parameters, so that N
                     consecutive ranks of the shard group (a node's GPUs) hold them
                     whole, and backward gathers over those N ranks only: more memory
                     between forward and backward than True, less traffic across
                     nodes. 1 is False and the group's size is True, as in FSDP2.
    prefetch_depth:  units all-gathered ahead of use, in the forward order recorded in
                     the first iteration (0: off). The root's value governs its tree.
    gather_bucket_bytes: (root) consecutive units, in the recorded forward order, whose
                     gathered parameters add up to at most this many bytes are
                     all-gathered by one coalesced collective (one c10d call for many
                     small units), in forward and backward; prefetching then runs a
                     bucket ahead. 0: one all-gather per unit. "auto" (default): the
                     budget at which a collective's fixed cost is at most 10% of its
                     time, from two all-gathers timed on the group at the end of the
                     first backward (megatron_fsdp_ext.link; the slowest rank's
                     times, so every rank plans alike; at most 256 MiB; 0 at world 1
                     and where nothing moves). bucket_budgets() says what was chosen.
    reduce_bucket_bytes: (root) the same for gradients: consecutive units whose packed
                     gradients (reduce dtype) add up to at most this many bytes are
                     reduce-scattered by one coalesced collective once the last of them
                     (the first in forward order) is done with backward; until then
                     their gradients wait unpacked. HSDP meshes and the full-gradient
                     strategies (no_shard, optim) reduce per unit. 0: one
                     reduce-scatter per unit; "auto" (default): as gather_bucket_bytes.
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
                     Tensor parallel: parameters that are DTensors on a "tp" mesh
                     (torch's parallelize_module) need `mesh`, the data-parallel dims of
                     the same job mesh (world_mesh["dp_shard"], or HSDP's
                     world_mesh[("dp_replicate", "dp_shard")]); each unit holds their
                     local TP shards, forward/backward see the DTensors TP gave, gradients
                     reduce over the data-parallel dims only and state dicts place values
                     as FSDP2+TP does (tensor_parallel.py).
    offload_policy:  FSDP2's. CPUOffloadPolicy(pin_memory=True) keeps this unit's shard (the
                     fp32 master weights), its gradient and so the optimizer state in host
                     memory (pinned: asynchronous copies); forward and backward compute on
                     the device. Each gather copies the shard in on the all-gather stream,
                     each reduction copies the reduced gradient out on the reduce-scatter
                     stream; the host waits once, at the end of backward. Step it with
                     megatron_fsdp_ext.optim.CPUAdamW (multithreaded, writes the bf16 copy
                     the next gather sends) or any torch optimizer. Per call: units left
                     without it stay on the device (partial offload). A module built on
                     the CPU is sharded without moving it whole to the device. Needs
                     'optim_grads_params' or 'optim_grads'. None / OffloadPolicy(): no offload.
    shard_placement_fn: FSDP2's: a function of each parameter returning Shard(dim) or None
                     (Shard(0)): state dicts and checkpoints shard that parameter's
                     DTensors on `dim`, as FSDP2 does. Training is the same whatever it
                     returns (a unit shards one flat buffer); other placements raise.
                     A ShardPlacementResult(placement, mesh_info) (torch's, as torchtitan
                     passes for mixture-of-experts) may also put the parameter on another
                     mesh (FSDPMeshInfo: 1-D; HSDPMeshInfo: 2-D replicate x shard): each
                     mesh gets its own unit within this call, gathered, reduced and
                     prefetched with it (MoE experts on the expert data-parallel mesh).
    timeout:         a datetime.timedelta (or seconds): every collective of this unit
                     fails after waiting this long, naming the unit and the phase,
                     instead of blocking for the process group's timeout (torch's
                     default is 30 minutes) when a rank stalls or desynchronizes. The
                     unit's collectives then run on groups created with this timeout
                     (cached; on NCCL that is one more communicator per role), so
                     `process_group` must span all ranks. None: the group's own timeout.
    dp_mesh_dims:    FSDP2's, for parameters that are DTensors on every axis of one SPMD
                     mesh (torchtitan's spmd_types / full_dtensor backends): not
                     supported; None. Tensor-parallel parameters (DTensors on a "tp"
                     mesh) are sharded with `mesh` the data-parallel mesh of the same job
                     (torchtitan's partial_dtensor backend, FSDP2's usual form).
    mp_policy may also be torch.distributed.fsdp.MixedPrecisionPolicy (same fields).
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims!r}): parameters that are DTensors on every axis of one SPMD "
            "mesh are not supported; apply tensor parallelism on the 'tp' axis only (torchtitan: "
            "parallelism.spmd_backend='partial_dtensor') and pass the data-parallel mesh as mesh=")
    _refuse_fsdp2_parameter_readers()
    modules = check_target(module)
    load_dynamo()
    mp_policy = as_mp_policy(mp_policy)
    process_group, replicate_group = groups_from_mesh(mesh, process_group)
    offload_pin = offload_pinning(offload_policy)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    strategy = strategy_named(sharding_strategy)
    reshard_after_forward, post_forward_shard_size = post_forward_size_of(
        reshard_after_forward, dist.get_world_size(pg))
    if reshard_after_forward is None:  # free after forward only where the strategy gathers per use
        reshard_after_forward = not strategy.keeps_unsharded
    # Checked here, before any work: contradictions (reshard_after_forward=True with a
    # strategy that keeps parameters unsharded), depth, flags, groups.
    options = UnitOptions(
        sharding_strategy=sharding_strategy, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
        post_forward_shard_size=post_forward_shard_size, prefetch_depth=prefetch_depth,
        gather_bucket_bytes=gather_bucket_bytes, reduce_bucket_bytes=reduce_bucket_bytes,
        all_gather_in_start_param_sync=all_gather_in_start_param_sync,
        overlap_grad_reduce=overlap_grad_reduce, check_for_nan_in_grad=check_for_nan_in_grad,
    )
    groups = CommGroups(pg, replicate_group, mesh, all_gather_group, reduce_scatter_group,
                        create_all_gather_group, timeout)
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError("ignored_params must be an iterable of parameters (e.g. [module.bias]), got a single tensor")
    ignored = frozenset(id(p) for p in (ignored_params or ()))
    params, names, slots, keys = collect_params(modules, ignored)
    build = dict(alignment=alignment, mp_policy=mp_policy, strategy=strategy, offload_pin=offload_pin,
                 check_for_nan_in_grad=check_for_nan_in_grad)
    states = []
    for group in placement_groups(params, names, shard_placement_fn, (pg, replicate_group)):
        comm = groups
        if group.mesh is not None:
            # Another mesh from shard_placement_fn (MoE experts on the expert data-parallel
            # mesh): a companion unit on it, with the call's settings and its own groups.
            comm = CommGroups(*groups_from_mesh(group.mesh, None), group.mesh, None, None,
                              create_all_gather_group, timeout)
        states.append(_group_state(modules, params, names, slots, keys, group, comm, options, **build))
    for s in states:
        s.ignored_param_ids = ignored
        live_states.add(s)
    state = states[0]
    state.companions = states[1:]
    for companion in state.companions:
        companion.leader = state
    for m in modules:
        m.__dict__["_mfsdp_state"] = state
        fsdp2_view.install(m, state.fsdp2_view)
        m.__class__ = _fsdp_class(type(m))
    shard_changes.ensure_step_hook_registered()
    # Initializers run after fully_shard (model.apply(init_fn)) draw whole parameters, as
    # one plain process does, until training starts.
    in_place_init.begin(states, uninitialized=False)
    return module
