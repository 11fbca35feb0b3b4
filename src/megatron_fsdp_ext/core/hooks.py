"""Per-unit state (FSDPState) and the module/autograd hooks that drive the C++ units.

Each hook does O(1) Python work per unit and, where it can, one call into C++: the
unit's ParamSlots gathers, waits and swaps the module's parameters in one call (use,
release). The C++ Unit holds everything per-parameter, the parameter objects included.
FSDPState holds a unit's state; its behaviour comes in parts, one job each:
forward_hooks (ForwardHooks), backward_hooks (BackwardHooks), residency (UnitResidency:
gathering and releasing outside the hooks), root_context (RootContext, make_root).
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import List, Optional, Tuple

import torch.nn as nn

from .. import _C
from .backward_hooks import BackwardHooks
from .forward_hooks import ForwardHooks
from .hook_support import run_outside_dynamo
from .options import UnitOptions
from .residency import UnitResidency
from .root_context import RootContext, make_root
from .states import BackwardProgress, GraphHold, ParamInit, SlotsHold


# Units by key, for the C++ post-backward marker node (it carries the key, not the state).
_STATES_BY_KEY: "weakref.WeakValueDictionary[int, FSDPState]" = weakref.WeakValueDictionary()
_next_key = itertools.count()


def _post_backward_of_key(key: int) -> None:
    state = _STATES_BY_KEY.get(key)
    if state is not None:
        state.post_backward_of_one_call()


_C.set_post_backward_callback(_post_backward_of_key)


def unit_kind(modules) -> str:
    """How a unit is named until the root's lazy init gives it its module path: the type(s)
    of its module(s), e.g. "Block" or "LayerNorm+Linear"."""
    return "+".join(type(m).__name__ for m in modules)


class FSDPState(ForwardHooks, BackwardHooks, UnitResidency):
    def __init__(self, modules, unit, names, slots, pg, options: UnitOptions, *,
                 check_group=None, deferred: bool = False, device_mesh=None, tp=None, collective_timeout=None):
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
        # fully_shard(timeout=): how long its collectives wait (None: the backend's default).
        self.collective_timeout = collective_timeout
        # HSDP: the 2-D (replicate, shard) mesh the unit was sharded on; None for 1-D.
        self.device_mesh = device_mesh
        # The 1-D mesh the unit was sharded on, when given one (its dim names are what the
        # unit's DTensors carry, as FSDP2's); None when sharded over a process group.
        self.shard_mesh = None
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
        # A unit whose parameters shard over several meshes (shard_placement_fn returning
        # ShardPlacementResult, FSDP2's MoE form: experts on the expert data-parallel mesh)
        # is one state per mesh, each with its own hooks on the same modules. The modules
        # point at the first (the leader: the call's own mesh); it lists the others.
        self.companions: List["FSDPState"] = []
        self.ignored_param_ids: frozenset = frozenset()  # ids of fully_shard's ignored_params
        self.leader: Optional["FSDPState"] = None
        self.mesh_tag = ""  # a companion's mesh, by its dim names (labels, errors)
        # Per parameter, the ShardedGrad type its .grad gets (grad_norm.py); set at lazy init.
        self.grad_types: list = []
        self.plain_types: list = []
        # Whether the gradients carry their grad_types now (from the end of backward to the
        # optimizer step's pre-hook, and after the step).
        self.grads_tagged = False
        # An optimizer step consumed the gradients since the last backward (their face stays,
        # the parameters' goes: sharded_param.py).
        self.grads_stepped = False
        self.backward_progress = BackwardProgress.NONE
        # Gathered again after its reduction in this backward (_gather_again_for_backward).
        self.reduce_again = False
        # Gathered parameters kept for a graph built by a create_graph backward.
        self.graph_hold = GraphHold.NONE
        # Forward calls of this unit whose backward has not finished yet (a unit may run
        # several times before one backward: weight sharing, summed micro-batches).
        self._pending_backward_calls = 0
        # Inside a method registered with register_fsdp_forward_method (e.g. generate):
        # the unit stays gathered for the whole method; forward calls within it only cast.
        self.method_active = False
        # Meta-device parameters: the shard is allocated but holds no values until
        # megatron_fsdp_ext.materialize() runs the modules' initializers.
        self.param_init = ParamInit.DEFERRED if deferred else ParamInit.MATERIALIZED
        # Deferred: the parameters (indices) a load_state_dict() has written so far.
        self._loaded_while_deferred: set = set()
        # (weakref to the owning module, handle id) of each load pre-hook ModuleStateDictHooks
        # registered: moved last at every load (FSDPModule._load_from_state_dict), so the
        # owner's hooks registered after fully_shard still see full values.
        self.own_load_pre_hooks: List[Tuple[weakref.ref, int]] = []
        # Values state_dict() handed out since the unit was last used: (parameter index,
        # its handed_out.HandedOutValue watch). Writes into them in place reach the shards
        # at the next use (state_dict.apply_state_dict_writes).
        self.handed_out: List[Tuple[int, object]] = []
        # What the unit was built from besides its parameters (retype.UnitRecipe): set by
        # fully_shard, read to build the unit again in another dtype.
        self.recipe = None
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
        # Per module, the id of our post-forward hook: kept last (ForwardHooks._keep_post_forward_last).
        self._post_forward_hook_ids = {id(m): self._handles[2 * k + 1].id for k, m in enumerate(modules)}

    def __str__(self) -> str:
        on = f" on {self.mesh_tag}" if self.mesh_tag else ""
        return f"{self.module_kind} (unit of {len(self.names)} parameters{on})"

    @property
    def with_companions(self) -> List["FSDPState"]:
        """This state and its companions on other meshes: what a module-level call acts on."""
        return [self, *self.companions]

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

    @property
    def modules(self) -> list:
        """The unit's modules (one, or those of fully_shard([...]))."""
        return [ref() for ref in self._module_refs]

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

    def lazy_init(self) -> None:
        """Make this state the root of every unit in its subtree (first forward or
        unshard()); root_context.make_root does it."""
        if self.ctx is None:
            make_root(self.leader or self)  # a companion's leader roots (it is the modules' state)

    def mark_loaded(self) -> None:
        """Every parameter of this unit now holds its value (materialize, or a load that
        wrote the whole unit): the one writer of param_init after construction."""
        self.param_init = ParamInit.MATERIALIZED

    @property
    def loaded_while_deferred(self) -> frozenset:
        return frozenset(self._loaded_while_deferred)

    def note_loaded(self, indices) -> None:
        """load_state_dict() is writing these parameters (state_dict.py's load pre-hook): a
        deferred unit whose every parameter was written, in one load or several, holds its
        values, as after materialize() (which then leaves it alone)."""
        if self.param_init is not ParamInit.DEFERRED:
            return
        self._loaded_while_deferred.update(indices)
        if len(self._loaded_while_deferred) == len(self.names):
            self._loaded_while_deferred.clear()
            self.mark_loaded()

    def set_options(self, **changes) -> None:
        """The one writer of this unit's options: a new frozen UnitOptions with
        `changes` (checked as at construction)."""
        self.options = dataclasses.replace(self.options, **changes)
        self.reshard_after_forward = self.options.reshard_after_forward and not self.is_root
