"""What all units under one root share (RootContext), and how a root takes its subtree
at the first forward (make_root)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge

from .. import _C
from . import grad_norm, in_place_init, link
from .extension_points import gather_transform
from .comm_buffers import apply_comm_buffer_source
from .consistency import check_units_agree
from .param_index import check_materialized
from .schedule import Schedule
from .states import BackwardProgress, RootPhase


def _will_accumulate_into(param) -> bool:
    """Whether the running backward will write `param`'s gradient. torch refuses the
    question for a parameter inside autograd.grad(), which writes no .grad at all."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:
        return False


class RootContext:
    """What all units under one root share: the C++ CommContext (streams, in-flight
    reductions), the schedule (which units gather when: schedule.py) and the
    per-backward bookkeeping."""

    def __init__(self, root, states: list, device: torch.device):  # root, states: hooks.FSDPState
        self.root = root
        self.states = states
        # Units of several modules (fully_shard([...])): the root resets their bookkeeping
        # of which members ran at the start of every forward.
        self.group_states = [s for s in states if len(s._module_refs) > 1]
        # The last unit with parameters: torch's pipelining reduces in this order, and its
        # post_backward completes the step (fsdp2_view).
        self.last_reducing = next((s for s in reversed(states) if s.unit is not None), None)
        self.device = device
        self.comm = _C.CommContext(device)
        self.phase = RootPhase.IDLE
        # The running backward has create_graph=True (set when its first hook runs).
        self.backward_builds_graph = False
        # Whether the running backward accumulates into any parameter of these units (not
        # autograd.grad with respect to inputs only); decided at its first reduction.
        self._accumulates: Optional[bool] = None
        self.schedule = Schedule(lambda: self.root.options)  # the root's settings govern its tree
        # The units' link as measured for the "auto" bucket budgets (link.py); None until then.
        self.link: Optional[link.LinkModel] = None
        # Units that gather FP8 weights (fp8.py): their scales are refreshed together.
        self.fp8_units = [s.unit for s in states if s.unit is not None and s.unit.gathers_bytes]
        # CPU offload: reduced gradients are copied to host memory, which the host reads.
        self.offloads = any(s.unit is not None and s.unit.offloaded for s in states)

    def refresh_fp8_scales(self) -> None:
        """Recompute stale FP8 scales (the shards changed since): one all-reduce(max) for
        all of them. Every rank reaches this at the same point (before a gather)."""
        if self.fp8_units:
            gather_transform().refresh_units(self.fp8_units)

    @property
    def in_backward(self) -> bool:
        return self.phase is RootPhase.BACKWARD

    def backward_accumulates(self) -> bool:
        """Whether the running backward writes any parameter's gradient here: a unit
        without a gradient on this rank joins the others' reduction only then (in an
        autograd.grad with respect to inputs no rank reduces anything, and joining would
        cost a collective per unit). Asked of the engine, once per backward: the first
        parameter it will accumulate into answers it (every unit's parameters only when
        none will: a backward that accumulates nothing)."""
        if not self.in_backward:
            return True  # finish_gradient_sync and flushes outside backward
        if self._accumulates is None:
            self._accumulates = any(_will_accumulate_into(p) for s in self.states if s.unit is not None
                                    for p in s.unit.unsharded_params if p.requires_grad)
        return self._accumulates

    def reduce_or_hold(self, state) -> bool:
        """With reduce buckets: `state`'s gradients wait (on its unsharded parameters)
        until every member of its bucket is done with backward, then the bucket is
        reduce-scattered by one coalesced collective. False when `state` reduces on its own."""
        held, ready = self.schedule.hold_for_reduction(state)
        if ready:
            _C.Unit.reduce_together([s.unit for s in ready], self.backward_accumulates())
        return held

    def queue_final_callback(self) -> None:
        if self.phase is RootPhase.BACKWARD:  # queued once per backward
            return
        self.phase = RootPhase.BACKWARD
        # Inside backward, grad mode is on exactly when it runs with create_graph=True.
        self.backward_builds_graph = torch.is_grad_enabled()
        self._accumulates = None
        Variable._execution_engine.queue_callback(self._final_callback)

    def abandon_backward(self) -> None:
        """Forget a backward that ended in an error: per-unit backward state reset, the
        held reduction waited for. The gradients it produced are incomplete: those still
        on unsharded parameters (units held for a reduce bucket, or whose post-backward
        never ran) are dropped, so the next backward does not add onto them. Gradients
        reduced before the error stay on the sharded parameters (zero_grad clears them)."""
        self.schedule.drop_held()
        for state in self.states:
            for p in state.unsharded_params:
                p.grad = None
            if state.unit is not None:
                for local in state.unit.unsharded_locals:
                    local.grad = None
        self.comm.wait_reductions()
        for state in self.states:
            state.end_backward()
        self.phase = RootPhase.IDLE

    def _final_callback(self) -> None:
        # Units whose post-backward hook did not fire (e.g. the root, whose inputs are
        # token ids) are reduced here, innermost last-used first.
        for state in reversed(self.states):
            if state.backward_progress is not BackwardProgress.REDUCED:
                state.post_backward(at_end=True)
        self._reduce_held()
        if self.offloads:  # the host reads offloaded .grads next: its one wait of the step
            self.comm.synchronize_reductions()
        else:
            self.comm.wait_reductions()
        self.end_backward()
        self.schedule.freeze()
        if self.link is None and self.schedule.wants_auto:
            given = self.root.options.link_model
            if given is not None:
                self._use_link(given)
            # Not while a CUDA graph is captured (the probe synchronizes): the next eager
            # backward measures, and buckets wait until then.
            elif not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._measure_link()

    def _reduce_held(self) -> None:
        """A bucket whose last member to finish did not sync (requires_gradient_sync off
        on that unit alone) was never reduced: now, last bucket first, the same order on
        every rank."""
        held = self.schedule.take_held()
        may_join = bool(held) and self.backward_accumulates()
        for members in held:
            _C.Unit.reduce_together([s.unit for s in members], may_join)

    def _measure_link(self) -> None:
        """Resolve the "auto" bucket budgets: time the link of the units' group (every
        rank reaches this at the end of the same backward)."""
        state = next(s for s in self.states if s.unit is not None)
        group = state.process_group
        if dist.get_world_size(group) == 1:
            self._use_link(link.LinkModel(alpha_s=0.0, bytes_per_s=math.inf))
        else:
            with torch.profiler.record_function("megatron_fsdp_ext::measure_link"):
                self._use_link(link.measure_link(group, self.device))

    def _use_link(self, model: "link.LinkModel") -> None:
        self.link = model
        self.schedule.auto_bucket_bytes = link.auto_bucket_bytes(model)

    def end_backward(self) -> None:
        """The gradients are final: give the new ones their ShardedGrad type (torch's norm
        code reduces them across ranks) and reset every unit's per-backward state."""
        for state in self.states:
            state.tag_grads()
            state.end_backward()
        self.phase = RootPhase.IDLE

    def finish_gradient_sync(self) -> None:
        """Reduce now what units accumulated with requires_gradient_sync off, outside any
        backward: what torch's pipelining does once per step (FSDP2's post_backward of every
        group, then its final callback) and Megatron's finish_grad_sync. Units whose sync
        is still off keep their accumulation. Returns once every .grad is complete."""
        if self.in_backward:
            raise RuntimeError("finish_gradient_sync: a backward is still running; call it after backward returned")
        for state in reversed(self.states):
            state.flush_accumulated()
        self._reduce_held()
        if self.offloads:
            self.comm.synchronize_reductions()
        else:
            self.comm.wait_reductions()
        self.end_backward()


def make_root(root) -> None:
    """Make `root` the root of every unit in its subtree (its first forward or unshard()):
    name each unit by its path, check the ranks built the same units, and give all of
    them one RootContext. A descendant that was made root earlier (e.g. by calling
    unshard() on it alone) is taken over."""
    if len(root._module_refs) > 1:
        raise ValueError(
            f"fully_shard([...]) unit of {root.module_kind} would be the root of its model (its forward ran "
            "first, or unshard() was called on it before any root): a unit of several modules is gathered "
            "around its members' forwards only; call fully_shard on their common parent too, as torchtitan "
            "does with the whole model")
    named, seen = [], set()  # a unit of several modules once, named by its first member
    for name, m in root.module.named_modules():
        s = m.__dict__.get("_mfsdp_state")
        if s is not None and id(s) not in seen:
            seen.add(id(s))
            named.append((name or f"{root.module_kind} (root)", s))
            named += [(f"{name or root.module_kind}[{c.mesh_tag}]", c) for c in s.companions]
    states = [s for _, s in named]
    check_materialized(states, "forward (or unshard())")
    in_place_init.end()
    for name, s in named:
        if s is not root and s.root_setters_called:
            raise ValueError(f"{sorted(s.root_setters_called)[0]} was called on {name or s.module_kind}, which is "
                             f"not the root of its model ({root.module_kind}); only the root's setting is used, "
                             "so call it on the root")
    device = next((s.unit.device for s in states if s.unit is not None), torch.device("cpu"))
    for name, s in named:
        if s.unit is not None and s.unit.device != device:
            raise ValueError(f"fully_shard: {s} is on {s.unit.device} but the root's units are on {device}")
        s.label = name  # profiler scopes and errors name the unit by its path in the model
        if s.unit is not None:
            s.unit.set_label(name)
    check_units_agree(named, device)
    ctx = RootContext(root, states, device)
    for s in states:
        s.ctx = ctx
        s.is_root = s is root
        s.reshard_after_forward = s.options.reshard_after_forward and not s.is_root
        if s.unit is not None:
            s.unit.set_context(ctx.comm)
            apply_comm_buffer_source(s)
            s.grad_types = grad_norm.unit_grad_types(s)
            s.plain_types = [torch.Tensor] * len(s.grad_types)
