"""Per-unit state and the module/autograd hooks that drive the C++ units.

Each hook does O(1) Python work per unit and, where it can, one call into C++: the
unit's ParamSlots gathers, waits and swaps the module's parameters in one call (use,
release). The C++ Unit holds everything per-parameter, the parameter objects included.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from typing import List, Optional

import torch
import torch.autograd.profiler as autograd_profiler
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import _C, fp8, grad_norm, link, shard_changes
from .consistency import check_units_agree
from .options import UnitOptions
from .param_index import check_materialized
from .schedule import Schedule
from .states import BackwardProgress, ParamInit, RootPhase, SlotsHold


def run_outside_dynamo(hook):
    """`hook`, run eagerly when Dynamo meets it (a graph break there, never a trace into
    it): our hooks call C++ units and collectives. Costs about 0.5 us a call in eager."""
    return torch._dynamo.disable(hook, recursive=True, reason="megatron_fsdp_ext unit hooks")


def profiled(phase: str):
    """Run the decorated FSDPState method under record_function("mfsdp::<phase>[<unit>]")
    while a profiler records, so a trace shows which unit each hook belongs to (the C++
    collectives carry "mfsdp::all_gather[<unit>]" and the like). Otherwise one flag read."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args):
            if not autograd_profiler._is_profiler_enabled:
                return method(self, *args)
            with torch.profiler.record_function(f"mfsdp::{phase}[{self.label}]"):
                return method(self, *args)
        return run
    return wrap


def _cast_floating(tree, dtype: torch.dtype):
    """Every floating-point tensor in `tree` cast to `dtype`; everything else as it is."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


class RootContext:
    """What all units under one root share: the C++ CommContext (streams, in-flight
    reductions), the schedule (which units gather when: schedule.py) and the
    per-backward bookkeeping."""

    def __init__(self, root: "FSDPState", states: List["FSDPState"], device: torch.device):
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
            fp8.refresh_units(self.fp8_units)

    @property
    def in_backward(self) -> bool:
        return self.phase is RootPhase.BACKWARD

    def reduce_or_hold(self, state: "FSDPState") -> bool:
        """With reduce buckets: `state`'s gradients wait (on its unsharded parameters)
        until every member of its bucket is done with backward, then the bucket is
        reduce-scattered by one coalesced collective. False when `state` reduces on its own."""
        held, ready = self.schedule.hold_for_reduction(state)
        if ready:
            _C.Unit.reduce_together([s.unit for s in ready])
        return held

    def queue_final_callback(self) -> None:
        if self.phase is RootPhase.BACKWARD:  # queued once per backward
            return
        self.phase = RootPhase.BACKWARD
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
                state.post_backward()
        # A bucket whose last member to finish did not sync (requires_gradient_sync off
        # on that unit alone) was never reduced: now, last bucket first, the same order
        # on every rank.
        for members in self.schedule.take_held():
            _C.Unit.reduce_together([s.unit for s in members])
        if self.offloads:  # the host reads offloaded .grads next: its one wait of the step
            self.comm.synchronize_reductions()
        else:
            self.comm.wait_reductions()
        self.end_backward()
        self.schedule.freeze()
        # Not while a CUDA graph is captured (the probe synchronizes): the next eager
        # backward measures, and buckets wait until then.
        if self.link is None and self.schedule.wants_auto and not (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._measure_link()

    def _measure_link(self) -> None:
        """Resolve the "auto" bucket budgets: time the link of the units' group (every
        rank reaches this at the end of the same backward)."""
        state = next(s for s in self.states if s.unit is not None)
        group = state.process_group
        if dist.get_world_size(group) == 1:
            self.link = link.LinkModel(alpha_s=0.0, bytes_per_s=math.inf)
        else:
            with torch.profiler.record_function("megatron_fsdp_ext::measure_link"):
                self.link = link.measure_link(group, self.device)
        self.schedule.auto_bucket_bytes = link.auto_bucket_bytes(self.link)

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
        if self.offloads:
            self.comm.synchronize_reductions()
        else:
            self.comm.wait_reductions()
        self.end_backward()


# Units by key, for the C++ post-backward marker node (it carries the key, not the state).
_STATES_BY_KEY: "weakref.WeakValueDictionary[int, FSDPState]" = weakref.WeakValueDictionary()
_next_key = itertools.count()


def _post_backward_of_key(key: int) -> None:
    state = _STATES_BY_KEY.get(key)
    if state is not None:
        state.post_backward_of_one_call()


_C.set_post_backward_callback(_post_backward_of_key)

def _same_type(marked: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """The marker's C++ view drops a subclass that only overrides __torch_function__
    (one with __torch_dispatch__, like DTensor, keeps its type): give it back, history kept."""
    return marked if type(marked) is type(original) else marked.as_subclass(type(original))


def _units_to_gather(states) -> list:
    """The C++ units of `states`, in order (states without parameters have none), right
    before C++ gathers them (ParamSlots.use, Unit.unshard_all): the one Python step of
    every hook's gathers, where GPU tests inject stream delays."""
    return [s.unit for s in states if s.unit is not None]


def _tensors_in(obj) -> list:
    """Every tensor in a forward output: in pytree's containers, and in dataclasses (a plain
    @dataclass output, Hugging Face's ModelOutput) that pytree does not look into."""
    found = []

    def visit(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for field in dataclasses.fields(x):
                visit(getattr(x, field.name))
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for v in x:
                visit(v)
        else:
            leaves = tree_flatten(x)[0]
            if not (len(leaves) == 1 and leaves[0] is x):
                for v in leaves:
                    visit(v)

    visit(obj)
    return found


# Arguments that are never containers: a call whose positional arguments are all tensors
# or these (and no keyword arguments) needs no pytree walk.
_SCALAR_TYPES = (int, float, bool, str, type(None))


def unit_kind(modules) -> str:
    """How a unit is named until the root's lazy init gives it its module path: the type(s)
    of its module(s), e.g. "Block" or "LayerNorm+Linear"."""
    return "+".join(type(m).__name__ for m in modules)


class FSDPState:
    def __init__(self, modules, unit, names, slots, pg, options: UnitOptions, *,
                 check_group=None, deferred: bool = False, device_mesh=None, tp=None):
        # A unit of several modules (FSDP2's fully_shard([...])) is gathered before the
        # first of them runs in a forward and released after the last (_group_pending).
        self._module_refs = [weakref.ref(m) for m in modules]
        self._group_pending: set = set()
        self.module_kind = unit_kind(modules)
        self.label = self.module_kind  # the module's path in the model, once lazy init ran
        # The group this unit's collectives wait on longest (its reduce-scatter group):
        # the cross-rank consistency check runs there, under the same timeout.
        self.check_group = check_group if check_group is not None else pg
        self.unit = unit
        self.names = names
        self.process_group = pg
        # HSDP: the 2-D (replicate, shard) mesh the unit was sharded on; None for 1-D.
        self.device_mesh = device_mesh
        # The unit's tensor-parallel (DTensor) parameters (tensor_parallel.py), or None.
        self.tp = tp
        self.options = options
        # The effective value: the root never reshards after forward (set at lazy init).
        self.reshard_after_forward = options.reshard_after_forward
        # Switched every micro-batch under gradient accumulation: state, not an option.
        self.requires_gradient_sync = True
        # Setters of root-only options called on this unit (refused at lazy init unless root).
        self.root_setters_called = set()
        # Explicit prefetch targets (set_modules_to_*_prefetch); None: recorded order.
        self.forward_prefetch: Optional[List["FSDPState"]] = None
        self.backward_prefetch: Optional[List["FSDPState"]] = None
        self.ctx: Optional[RootContext] = None
        self.is_root = False
        # Per parameter, the ShardedGrad type its .grad gets (grad_norm.py); set at lazy init.
        self.grad_types: list = []
        self.plain_types: list = []
        self.backward_progress = BackwardProgress.NONE
        # Gathered again after its reduction in this backward (_gather_again_for_backward).
        self.reduce_again = False
        # Forward calls of this unit whose backward has not finished yet (a unit may run
        # several times before one backward: weight sharing, summed micro-batches).
        self._pending_backward_calls = 0
        # Inside a method registered with register_fsdp_forward_method (e.g. generate):
        # the unit stays gathered for the whole method; forward calls within it only cast.
        self.method_active = False
        # Meta-device parameters: the shard is allocated but holds no values until
        # megatron_fsdp_ext.materialize() runs the modules' initializers.
        self.param_init = ParamInit.DEFERRED if deferred else ParamInit.MATERIALIZED
        self.key = next(_next_key)
        _STATES_BY_KEY[self.key] = self

        # The module's parameter slots; the parameter objects themselves live in the unit.
        self.slots = _C.ParamSlots(unit)
        sharded = self.sharded_params
        for params_dict, name, index in slots:
            self.slots.add(params_dict, name, index)
            params_dict[name] = sharded[index]
        owner = weakref.ref(self)
        for p in sharded:
            p._mfsdp_owner = owner
        # The hooks drive C++ units Dynamo cannot trace: disabled for it, they run eagerly
        # outside any graph (as FSDP2's do), so `block.compile(fullgraph=True)` traces the
        # block alone and a whole-model torch.compile breaks its graphs only here.
        self._handles = [h for m in modules for h in (
            m.register_forward_pre_hook(run_outside_dynamo(self._pre_forward), prepend=True, with_kwargs=True),
            m.register_forward_hook(run_outside_dynamo(self._post_forward), prepend=False),
        )]

    def __str__(self) -> str:
        return f"{self.module_kind} (unit of {len(self.names)} parameters)"

    @property
    def sharded_params(self) -> List[nn.Parameter]:
        """The unit's sharded parameters (1-D views of this rank's shard), read from the
        C++ unit, their one holder; a new list each time."""
        return self.unit.sharded_params if self.unit is not None else []

    @property
    def unsharded_params(self) -> List[nn.Parameter]:
        """The unit's unsharded parameters (views of the gathered buffer), from the unit."""
        return self.unit.unsharded_params if self.unit is not None else []

    @property
    def slots_hold(self) -> SlotsHold:
        """Which parameters the module's slots hold: kept by the C++ slots, which swap them."""
        return SlotsHold.UNSHARDED if self.slots.holds_unsharded else SlotsHold.SHARDED

    @property
    def module(self) -> nn.Module:
        """The unit's module (the first, for a unit of several)."""
        return self._module_refs[0]()

    def _group_starts(self, module) -> bool:
        """Whether this module's forward is the first of the unit's modules in this pass. A
        member that runs again after its own forward in this pass starts a new one (e.g.
        torchtitan's chunked loss calling lm_head once a chunk, outside the model's forward,
        while norm never runs again): the unit is gathered for it."""
        if len(self._module_refs) == 1:
            return True
        if id(module) in self._group_pending:
            return False
        self._group_pending = {id(ref()) for ref in self._module_refs}
        return True

    def _group_ends(self, module) -> bool:
        """Whether this module's forward is the last of the unit's modules in this pass."""
        if len(self._module_refs) == 1:
            return True
        self._group_pending.discard(id(module))
        return not self._group_pending

    # ------------------------------------------------------------ lazy init

    def lazy_init(self) -> None:
        """Make this state the root of every unit in its subtree (first forward or
        unshard()). A descendant that was made root earlier (e.g. by calling unshard()
        on it alone) is taken over."""
        if self.ctx is not None:
            return
        if len(self._module_refs) > 1:
            raise ValueError(
                f"fully_shard([...]) unit of {self.module_kind} would be the root of its model (its forward ran "
                "first, or unshard() was called on it before any root): a unit of several modules is gathered "
                "around its members' forwards only; call fully_shard on their common parent too, as torchtitan "
                "does with the whole model")
        named, seen = [], set()  # a unit of several modules once, named by its first member
        for name, m in self.module.named_modules():
            s = m.__dict__.get("_mfsdp_state")
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                named.append((name or f"{self.module_kind} (root)", s))
        states = [s for _, s in named]
        check_materialized(states, "forward (or unshard())")
        for name, s in named:
            if s is not self and s.root_setters_called:
                raise ValueError(f"{sorted(s.root_setters_called)[0]} was called on {name or s.module_kind}, which is "
                                 f"not the root of its model ({self.module_kind}); only the root's setting is used, "
                                 "so call it on the root")
        device = next((s.unit.device for s in states if s.unit is not None), torch.device("cpu"))
        for name, s in named:
            if s.unit is not None and s.unit.device != device:
                raise ValueError(f"fully_shard: {s} is on {s.unit.device} but the root's units are on {device}")
            s.label = name  # profiler scopes and errors name the unit by its path in the model
            if s.unit is not None:
                s.unit.set_label(name)
        check_units_agree(named, device)
        ctx = RootContext(self, states, device)
        for s in states:
            s.ctx = ctx
            s.is_root = s is self
            s.reshard_after_forward = s.options.reshard_after_forward and not s.is_root
            if s.unit is not None:
                s.unit.set_context(ctx.comm)
                s.grad_types = grad_norm.unit_grad_types(s.unit, s.process_group, s.tp)
                s.plain_types = [None if t is None else torch.Tensor for t in s.grad_types]

    def set_options(self, **changes) -> None:
        """The one writer of this unit's options: a new frozen UnitOptions with
        `changes` (checked as at construction)."""
        self.options = dataclasses.replace(self.options, **changes)
        self.reshard_after_forward = self.options.reshard_after_forward and not self.is_root

    # ------------------------------------------------------------ unshard / reshard

    def unshard(self) -> None:
        if self.unit is not None:
            if self.unit.fp8_scales_stale:
                self.ctx.refresh_fp8_scales()
            self.unit.unshard()

    def wait_unshard(self) -> None:
        self._adopt_replaced(self.slots.use([], False), unsharded=True)

    def reshard(self) -> None:
        self._adopt_replaced(self.slots.release(False), unsharded=False)

    def mark_loaded(self) -> None:
        """Every parameter of this unit now holds its value (materialize, or a load that
        wrote the whole unit): the one writer of param_init after construction."""
        self.param_init = ParamInit.MATERIALIZED

    @property
    def keeps_params_unsharded(self) -> bool:
        """Strategies other than optim_grads_params keep the unsharded copy between uses."""
        return self.unit is not None and self.options.keeps_params_unsharded

    def release(self, keep_unsharded: bool = False) -> None:
        """Done with the unsharded parameters for now: the module's slots get the sharded
        ones back; the memory is freed unless the strategy keeps it (or `keep_unsharded`;
        the next use then gathers again only if the shards changed)."""
        self._adopt_replaced(self.slots.release(keep_unsharded or self.keeps_params_unsharded), unsharded=False)

    def _adopt_replaced(self, replaced: List[int], unsharded: bool) -> None:
        """After the slots got the unsharded (or sharded) parameters: slots the user
        re-assigned since the last install (module.weight = nn.Parameter(...)) give their
        values to the unit, then the slots are installed again."""
        if not replaced:
            return
        shard_changes.adopt_replaced_params(self, replaced)
        if unsharded:  # the gathered copy predates the new values: gather again, then install
            self.slots.use([], False)
        else:
            self.slots.install(False)

    def start_param_sync(self) -> None:
        """Launch the all-gathers the next forward needs first (the root's and, with
        prefetching, the next units'), e.g. right after the optimizer step so they
        overlap data loading. A no-op unless all_gather_in_start_param_sync is on,
        so that by default nothing is launched outside forward (CUDA-graph safe)."""
        if not self.options.all_gather_in_start_param_sync:
            return
        self.lazy_init()
        ctx = self.ctx
        first = ctx.schedule.first_gathers(self)
        # Strategies that keep params unsharded hold memory for every unit anyway: all
        # stale ones are gathered again now, in forward order (after a reshard() or a
        # checkpoint load this allocates every unit's copy here, outside forward).
        persistent = [s for s in (ctx.schedule.forward_order or ctx.states) if s.keeps_params_unsharded]
        for state in dict.fromkeys(first + persistent):
            state.unshard()

    # ------------------------------------------------------------ registered forward methods

    def enter_method(self, module, args, kwargs):
        """Before a method registered as a forward method (ours or torch's
        register_fsdp_forward_method): gather for the whole call; a registered method
        called inside another runs as it is."""
        if self.method_active:
            return args, kwargs
        args, kwargs = self._pre_forward(module, args, kwargs)
        self.method_active = True
        return args, kwargs

    def exit_method(self, module, args, output, outermost: bool = True):
        """After the registered method: release as after forward. No backward can follow
        an output without grad (generate runs under no_grad): the unit is then released
        as after a no_grad forward."""
        if not outermost:
            return output
        self.method_active = False
        needs_backward = any(t.requires_grad for t in _tensors_in(output))
        with torch.set_grad_enabled(needs_backward):
            return self._post_forward(module, args, output)

    # ------------------------------------------------------------ forward hooks

    @profiled("pre_forward")
    def _pre_forward(self, module, args, kwargs):
        if self.ctx is None:
            self.lazy_init()
        if self.is_root and self.ctx.in_backward and torch._C._current_graph_task_id() == -1:
            # The last backward raised before its final callback: no backward is running
            # now, so its per-backward state is stale (it would keep this forward from
            # registering the post-backward markers).
            self.ctx.abandon_backward()
        mp = self.options.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), mp.param_dtype)
        if self.method_active:
            return args, kwargs
        if self.is_root:
            for s in self.ctx.group_states:  # a member that did not run last time must not block this one
                s._group_pending.clear()
            self.ctx.refresh_fp8_scales()  # after a load or a step without the optimizer hook
        if self._group_starts(module):
            self.ctx.schedule.record_forward(self)
            # Issue the next units' all-gathers before waiting on ours: they run on the
            # all-gather stream while this unit computes. Not in a forward re-run inside
            # backward (activation checkpointing): the next units are done there.
            gathers, bucketed = ([self], False) if self.ctx.in_backward else self.ctx.schedule.forward_gathers(self)
            self._adopt_replaced(self.slots.use(_units_to_gather(gathers), bucketed), unsharded=True)
        if torch.is_grad_enabled() and not self.ctx.in_backward:
            self.backward_progress = BackwardProgress.NONE
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _register_post_backward(self, args, kwargs):
        """The inputs that need a gradient go through the C++ post-backward marker, whose
        backward calls post_backward_of_one_call() once this forward call's backward is done."""
        flat_args = not kwargs and all(isinstance(a, (torch.Tensor, *_SCALAR_TYPES)) for a in args)
        flat, spec = (list(args), None) if flat_args else tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        self._pending_backward_calls += 1
        outs = _C.mark_post_backward(self.key, [flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = _same_type(t, flat[i])
        return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)

    @profiled("post_forward")
    def _post_forward(self, module, args, output):
        if self.method_active:
            return self._cast_output(output)
        grad_enabled = torch.is_grad_enabled()
        # A forward re-run inside backward (activation checkpointing) keeps the unit
        # gathered: its backward comes right after.
        if self._group_ends(module) and (self.reshard_after_forward or not grad_enabled) and \
                not self.ctx.in_backward:
            self.release()
        if self.is_root and not grad_enabled:
            # No backward follows: a prefetched unit that did not run must not stay gathered.
            for s in self.ctx.states:
                s.release()
        output = self._cast_output(output)
        if grad_enabled:
            for t in ((output,) if isinstance(output, torch.Tensor) else _tensors_in(output)):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    def _cast_output(self, output):
        output_dtype = self.options.mp_policy.output_dtype
        if output_dtype is None:
            return output
        return _cast_floating(output, output_dtype)

    # ------------------------------------------------------------ backward hooks

    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return None

    @profiled("pre_backward")
    def pre_backward(self) -> None:
        if self.backward_progress is BackwardProgress.REDUCED:
            self._gather_again_for_backward()
            return
        if self.backward_progress is not BackwardProgress.NONE:
            return
        self.backward_progress = BackwardProgress.GATHERED
        self.ctx.queue_final_callback()
        targets, bucketed = self.ctx.schedule.backward_gathers(self)
        if self.options.unshard_in_backward:
            self._adopt_replaced(self.slots.use(_units_to_gather([self] + targets), bucketed), unsharded=True)
        else:
            _C.Unit.unshard_all(_units_to_gather(targets), bucketed)

    def _gather_again_for_backward(self) -> None:
        """The backward of one more call of this unit starts after the unit was reduced: a
        call whose inputs needed no gradient (no post-backward marker: a tied embedding's
        lookup on token ids, a shared layer applied to the raw input) or an output consumed
        late. Gather for it (its backward may read the weights) and reduce again at the end
        of backward: what it adds lands on top of the reduced gradients."""
        self.backward_progress = BackwardProgress.GATHERED
        self.reduce_again = True
        self.ctx.queue_final_callback()
        if self.options.unshard_in_backward:
            self._adopt_replaced(self.slots.use(_units_to_gather([self]), False), unsharded=True)

    def post_backward_of_one_call(self) -> None:
        """The backward of one forward call is done; reduce once all of them are."""
        self._pending_backward_calls = max(0, self._pending_backward_calls - 1)
        if self._pending_backward_calls == 0:
            self.post_backward()
        else:
            self.ctx.queue_final_callback()

    @profiled("post_backward")
    def post_backward(self) -> None:
        if self.backward_progress is BackwardProgress.REDUCED:
            return
        self.backward_progress = BackwardProgress.REDUCED
        self.ctx.queue_final_callback()
        if self.unit is None:
            return
        if self.tp is not None:
            self.tp.move_grads(self.unit)
        # Without sync the gradients only accumulate locally: nothing to bucket. A second
        # reduction in one backward goes alone (its bucket, if any, has moved on).
        if self.reduce_again or not (self.requires_gradient_sync and self.ctx.reduce_or_hold(self)):
            self.unit.reduce_grads(self.requires_gradient_sync)
        if not self.options.overlap_grad_reduce:
            self.ctx.comm.wait_reductions()
        self._release_after_backward()

    def _release_after_backward(self) -> None:
        """After a unit's backward: free the gathered parameters and give the slots the
        shards back. Without reshard_after_backward the gathered memory stays; so do the
        unsharded parameters in the slots while gradients only accumulate (sync off: torch's
        pipelining between micro-batches), as FSDP2 leaves them: a split backward
        (BACKWARD_INPUT, then BACKWARD_WEIGHT) reads the weights from module.parameters()
        on both sides of this hook and adds dW to the objects it found first."""
        if self.options.reshard_after_backward or self.requires_gradient_sync:
            self.release(keep_unsharded=not self.options.reshard_after_backward)

    def flush_accumulated(self) -> None:
        """Reduce the gradients accumulated without sync (and any left on the unsharded
        parameters), then release as after a post-backward. Nothing to do when sync is
        off or nothing was accumulated."""
        if self.unit is None:
            return
        if self.tp is not None:
            self.tp.move_grads(self.unit)
        if self.requires_gradient_sync:
            self.unit.reduce_grads(True)
        self._release_after_backward()

    def tag_grads(self) -> None:
        """Give the new gradients their ShardedGrad type (grad_norm.py)."""
        if self.grad_types:
            self.unit.retype_grads(self.plain_types, self.grad_types)

    def untag_grads(self) -> None:
        """Plain gradients again for the optimizer step (shard_changes' step pre-hook): an
        optimizer reads them per parameter, and a subclass costs a Python dispatch on each
        read; torch's and torchtitan's clip run before the step."""
        if self.grad_types:
            self.unit.retype_grads(self.grad_types, self.plain_types)

    def end_backward(self) -> None:
        self.backward_progress = BackwardProgress.NONE
        self.reduce_again = False
        self._pending_backward_calls = 0
        if self.unit is not None and not self.slots.holds_unsharded:
            # A slot the user re-assigned (module.weight = nn.Parameter(full)) on a unit this
            # step did not call: adopted now, so model.parameters() yields the unit's shard
            # (an optimizer built from it then steps the unit), as for a unit that ran.
            self._adopt_replaced(self.slots.install(False), unsharded=False)
