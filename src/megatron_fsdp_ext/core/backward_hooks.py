"""The backward side of a unit's hooks (a mixin of FSDPState): gather before the
unit's backward, reduce-scatter after it (alone or in a reduce bucket), gradient
accumulation without sync, and the per-backward state reset."""
from __future__ import annotations

import torch

from .. import _C
from . import hook_support
from .hook_support import profiled
from .state_dict import apply_state_dict_writes_of
from .states import BackwardProgress, GraphHold


class BackwardHooks:
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
        apply_state_dict_writes_of([self] + targets, "backward")
        if self.options.unshard_in_backward:
            self._adopt_replaced(self.slots.use(hook_support.units_to_gather([self] + targets), bucketed), unsharded=True)
        else:
            _C.Unit.unshard_all(hook_support.units_to_gather(targets), bucketed)

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
            self._adopt_replaced(self.slots.use(hook_support.units_to_gather([self]), False), unsharded=True)

    def post_backward_of_one_call(self) -> None:
        """The backward of one forward call is done; reduce once all of them are."""
        self._pending_backward_calls = max(0, self._pending_backward_calls - 1)
        if self._pending_backward_calls == 0:
            self.post_backward()
        else:
            self.ctx.queue_final_callback()

    @profiled("post_backward")
    def post_backward(self, at_end: bool = False) -> None:
        """`at_end`: called by the final callback, once every node of this backward ran."""
        if self.backward_progress is BackwardProgress.REDUCED:
            return
        self.ctx.queue_final_callback()
        if self.ctx.backward_builds_graph:
            self._hold_for_graph()
            return
        if self.graph_hold is GraphHold.HELD:
            # The higher-order graph's nodes read these parameters and add to their
            # gradients outside this unit's forward graph, possibly after this hook:
            # reduced once the whole backward is done.
            if not at_end:
                return
            self.graph_hold = GraphHold.NONE
        self.backward_progress = BackwardProgress.REDUCED
        if self.unit is None:
            return
        if self.tp is not None:
            self.tp.move_grads(self.unit)
        # The gathered parameters go before the packed gradients are allocated (the unsharded
        # gradients stay on the parameter objects the unit holds): a unit's reduction then
        # costs its gradients only, not gradients and parameters, as in FSDP2, which also
        # reshards before its reduce-scatter input exists.
        self._release_after_backward()
        # Without sync the gradients only accumulate locally: nothing to bucket. A second
        # reduction in one backward goes alone (its bucket, if any, has moved on).
        if self.reduce_again or not (self.requires_gradient_sync and self.ctx.reduce_or_hold(self)):
            self.unit.reduce_grads(self.requires_gradient_sync,
                                   not self.requires_gradient_sync or self.ctx.backward_accumulates())
        if not self.options.overlap_grad_reduce:
            self.ctx.comm.wait_reductions()

    def _hold_for_graph(self) -> None:
        """This backward runs with create_graph=True (autograd.grad of a gradient penalty):
        the graph it builds saved the gathered parameters, and its own backward (the next
        one) reads them. A unit gathered for this backward keeps them gathered until then
        (the module's slots get the shards back, as after any backward). Gradients with a
        graph of their own on the parameters (backward(create_graph=True) into them) are
        refused: a reduce-scatter cannot carry their graph to the shards."""
        gathered = self.backward_progress is BackwardProgress.GATHERED
        self.backward_progress = BackwardProgress.REDUCED
        if self.unit is None:
            return
        params = list(self.unsharded_params) + list(self.unit.unsharded_locals)
        if any(p.grad is not None and p.grad.requires_grad for p in params):
            raise NotImplementedError(
                f"megatron_fsdp_ext: backward with create_graph=True wrote gradients that carry a graph "
                f"into the parameters of fully_shard unit '{self.label}'; a sharded gradient cannot keep "
                f"that graph. Take higher-order gradients with torch.autograd.grad(..., inputs=<tensors "
                f"that are not parameters, e.g. the model's input>, create_graph=True) (a gradient "
                f"penalty), then call backward() on the total loss")
        if gathered:
            self.graph_hold = GraphHold.HELD
            self.release()

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
        parameters), then release as after a post-backward: through the unit's reduce
        bucket, as in backward, once every member of it flushed. Nothing to do when sync
        is off, nothing was accumulated, or the unit flushed already in this sync."""
        if self.unit is None or self.backward_progress is BackwardProgress.REDUCED:
            return
        if self.tp is not None:
            self.tp.move_grads(self.unit)
        self._release_after_backward()  # before the packed gradients, as in post_backward
        if self.requires_gradient_sync:
            self.backward_progress = BackwardProgress.REDUCED
            if not self.ctx.reduce_or_hold(self):
                self.unit.reduce_grads(True)

    def tag_grads(self, stepped: bool = False) -> None:
        """Give the gradients their ShardedGrad type (grad_norm.py): the new ones at the end
        of backward, or (`stepped`) the ones an optimizer step just read as plain tensors, so
        that norms taken after it (logging, a late clip) are still global, as FSDP2's DTensor
        gradients' are until zero_grad; the parameters then stop presenting as DTensors
        (sharded_param.py): the step consumed their gradients."""
        self.grads_stepped = stepped
        if self.grad_types:
            self.unit.retype_grads(self.plain_types, self.grad_types)
            self.grads_tagged = True

    def retag_grad(self, index: int) -> None:
        """Parameter `index`'s gradient, assigned as a plain tensor while the unit's
        gradients carry their ShardedGrad types, takes its type too."""
        none = [None] * len(self.grad_types)
        self.unit.retype_grads(none[:index] + [torch.Tensor] + none[index + 1:],
                               none[:index] + [self.grad_types[index]] + none[index + 1:])

    def untag_grads(self) -> None:
        """Plain gradients again for the optimizer step (shard_changes' step pre-hook): an
        optimizer reads them per parameter, and a subclass costs a Python dispatch on each
        read; torch's and torchtitan's clip run before the step."""
        if self.grad_types:
            self.unit.retype_grads(self.grad_types, self.plain_types)
        self.grads_tagged = False

    def end_backward(self) -> None:
        self.backward_progress = BackwardProgress.NONE
        self.reduce_again = False
        self._pending_backward_calls = 0
        if self.unit is not None and not self.slots.holds_unsharded:
            # A slot the user re-assigned (module.weight = nn.Parameter(full)) on a unit this
            # step did not call: adopted now, so model.parameters() yields the unit's shard
            # (an optimizer built from it then steps the unit), as for a unit that ran.
            self._adopt_replaced(self.slots.install(False), unsharded=False)
