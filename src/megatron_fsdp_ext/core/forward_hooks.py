"""The forward side of a unit's hooks (a mixin of FSDPState): gather before the
module runs, release after it, the post-backward markers on the inputs and the
pre-backward hooks on the outputs, and methods registered to run gathered."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _C
from . import hook_support
from .hook_support import cast_call_inputs, cast_floating, is_flat_call, profiled, same_type, tensors_in
from .state_dict import apply_state_dict_writes_of
from .states import BackwardProgress


def _refuse_compiled_autograd() -> None:
    """Compiled autograd traces the backward into a graph; a unit's gathers and reductions
    are side effects of its hooks that the graph cannot hold. Refused at the root's forward
    when switched on globally; a backward run under compiled_autograd._enable fails at the
    post-backward marker, which names itself."""
    if getattr(torch._dynamo.config, "compiled_autograd", False):
        raise NotImplementedError(
            "megatron_fsdp_ext: fully_shard units do not support compiled autograd "
            "(torch._dynamo.config.compiled_autograd is on); turn it off: torch.compile of the "
            "model or its blocks works without it")


class ForwardHooks:
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
        needs_backward = any(t.requires_grad for t in tensors_in(output))
        with torch.set_grad_enabled(needs_backward):
            return self._post_forward(module, args, output)

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
            args, kwargs = cast_call_inputs(args, kwargs, mp.param_dtype)
        if self.method_active:
            return args, kwargs
        self._keep_post_forward_last(module)
        if self.is_root:
            _refuse_compiled_autograd()
            for s in self.ctx.group_states:  # a member that did not run last time must not block this one
                s._group_pending.clear()
            # Before any gather of this forward, prefetches included.
            apply_state_dict_writes_of(self.ctx.states, "forward")
            self.ctx.refresh_fp8_scales()  # after a load or a step without the optimizer hook
        if self._group_starts(module):
            self.ctx.schedule.record_forward(self)
            # Issue the next units' all-gathers before waiting on ours: they run on the
            # all-gather stream while this unit computes. Not in a forward re-run inside
            # backward (activation checkpointing): the next units are done there.
            gathers, bucketed = ([self], False) if self.ctx.in_backward else self.ctx.schedule.forward_gathers(self)
            apply_state_dict_writes_of(gathers, "forward")  # a forward of a module below the root
            self._adopt_replaced(self.slots.use(hook_support.units_to_gather(gathers), bucketed), unsharded=True)
        if torch.is_grad_enabled() and not self.ctx.in_backward:
            self.backward_progress = BackwardProgress.NONE
            if self.unit is not None:
                # Every rank ran this forward: each joins the unit's next reduction, also
                # one whose parameters got no gradient here (used on other ranks only).
                self.unit.expect_reduction()
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _keep_post_forward_last(self, module) -> None:
        """Our post-forward hook runs after every forward hook of the module, also those
        registered after fully_shard: they see the unsharded parameters, as forward hooks
        see a plain module's (after ours they would read this rank's piece)."""
        hooks = module._forward_hooks
        ours = self._post_forward_hook_ids[id(module)]
        if hooks and next(reversed(hooks)) != ours and ours in hooks:
            hooks.move_to_end(ours)

    def _register_post_backward(self, args, kwargs):
        """The inputs that need a gradient go through the C++ post-backward marker, whose
        backward calls post_backward_of_one_call() once this forward call's backward is done."""
        flat, spec = (list(args), None) if is_flat_call(args, kwargs) else tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        self._pending_backward_calls += 1
        outs = _C.mark_post_backward(self.key, [flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = same_type(t, flat[i])
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
            self.release(after_forward=grad_enabled)
        if self.is_root and not grad_enabled:
            # No backward follows: a prefetched unit that did not run must not stay gathered.
            for s in self.ctx.states:
                s.release()
        output = self._cast_output(output)
        if grad_enabled:
            for t in ((output,) if isinstance(output, torch.Tensor) else tensors_in(output)):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    def _cast_output(self, output):
        output_dtype = self.options.mp_policy.output_dtype
        if output_dtype is None:
            return output
        return cast_floating(output, output_dtype)
