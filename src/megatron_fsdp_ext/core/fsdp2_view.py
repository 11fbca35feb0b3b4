"""The face our units show to torch code that reaches into FSDP2's private state.

torch's pipelining (`torch/distributed/pipelining/stage.py`, `perform_reduce_grad`) runs,
once per step after the last micro-batch of a stage whose module is an FSDPModule:

    state = fully_shard.state(module)
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:   # torch 2.11: s._fsdp_param_group
            group.post_backward()
    state._root_post_backward_final_callback()

and `FSDPModule._get_fsdp_state()` is what torch's own methods read. `Fsdp2StateView`
answers exactly those names with our units' behaviour: `post_backward()` reduces what a
unit accumulated under `set_requires_gradient_sync(False)`; the final callback waits for
every reduction and finishes the gradients. Any other FSDP2-internal name raises an error
that names it, instead of silently doing nothing.

`install(module, state)` puts the view where `fully_shard.state(module)` looks
(the composable-API state dict in `module.__dict__`, keyed by torch's undecorated
`fully_shard`), without claiming FSDP2's registry entry (torch's `replicate` reads that to
refuse mixing with FSDP2's own fully_shard).
"""
from __future__ import annotations

import weakref

from torch.distributed._composable.contract import STATE_KEY as _COMPOSABLE_STATE_KEY
from torch.distributed.fsdp import fully_shard as _torch_fully_shard


def _torch_fully_shard_key():
    # contract() keys a module's state by the function it decorated.
    return getattr(_torch_fully_shard, "__wrapped__", _torch_fully_shard)


class _Unsupported:
    """Any FSDP2-internal attribute we do not provide: an error naming it."""

    _what = "FSDP2 state"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"{self._what}.{name}: this module was sharded by megatron_fsdp_ext, whose units are not FSDP2's; "
            "torch code that reads FSDP2's private state beyond what pipelining uses (fully_shard.state(m)."
            "_state_ctx.all_states[*]._fsdp_param_groups[*] (or ._fsdp_param_group).post_backward(), "
            "_root_post_backward_final_callback()) is not supported")


class ParamGroupView(_Unsupported):
    """FSDP2's FSDPParamGroup as pipelining uses it: one per unit with parameters."""

    _what = "FSDPParamGroup"

    def __init__(self, state):
        self._state_ref = weakref.ref(state)

    @property
    def _state(self):
        return self._state_ref()

    def post_backward(self) -> None:
        state = self._state
        if state.ctx is None:  # no forward ran: nothing to reduce
            return
        state.flush_accumulated()
        # Some torch versions call no final callback after the groups' post_backward: the
        # last unit's completes the step (waits, finishes the gradients); a final callback
        # after it finds nothing left to do.
        if state is state.ctx.last_reducing:
            state.ctx.finish_gradient_sync()

    def lazy_init(self) -> None:
        self._state.lazy_init()

    def unshard(self, async_op: bool = False) -> None:
        state = self._state
        state.lazy_init()
        state.unshard()
        if not async_op:
            state.wait_unshard()

    def wait_for_unshard(self) -> None:
        self._state.wait_unshard()

    def reshard(self) -> None:
        self._state.reshard()


class StateContextView(_Unsupported):
    """FSDP2's FSDPStateContext: every state of the root's tree."""

    _what = "FSDPStateContext"

    def __init__(self, state):
        self._state_ref = weakref.ref(state)
        self.is_last_backward = True

    @property
    def all_states(self):
        state = self._state_ref()
        ctx = state.ctx
        states = ctx.states if ctx is not None else [state]
        return [s.fsdp2_view for s in states]


class Fsdp2StateView(_Unsupported):
    """FSDP2's FSDPState, as torch's pipelining and FSDPModule's methods read it."""

    _what = "FSDPState"

    def __init__(self, state):
        self._state_ref = weakref.ref(state)
        self._state_ctx = StateContextView(state)
        self._fsdp_param_groups = [ParamGroupView(state)] if state.unit is not None else []

    def _pre_forward(self, module, args, kwargs):
        """torch's register_fsdp_forward_method: before the registered method."""
        state = self._state_ref()
        self._outermost = not state.method_active
        return state.enter_method(module, args, kwargs)

    def _post_forward(self, module, args, output):
        """torch's register_fsdp_forward_method: after the registered method."""
        outermost, self._outermost = getattr(self, "_outermost", True), True
        return self._state_ref().exit_method(module, args, output, outermost)

    @property
    def _fsdp_param_group(self):
        """FSDP2's one-group accessor (torch 2.11's pipelining reads this one)."""
        return self._fsdp_param_groups[0] if self._fsdp_param_groups else None

    def _root_post_backward_final_callback(self) -> None:
        state = self._state_ref()
        if state.ctx is None:
            return
        state.ctx.finish_gradient_sync()

    def _lazy_init(self) -> None:
        self._state_ref().lazy_init()


def install(module, view: Fsdp2StateView) -> None:
    """Make `torch.distributed.fsdp.fully_shard.state(module)` return `view`."""
    states = module.__dict__.setdefault(_COMPOSABLE_STATE_KEY, {})
    states[_torch_fully_shard_key()] = view
