"""Gathering and releasing a unit's parameters outside the hooks' fixed order (a mixin
of FSDPState): explicit unshard/reshard, releasing by strategy, parameters the user
replaced, and the gathers launched ahead of the next forward."""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from . import shard_changes
from .state_dict import apply_state_dict_writes_of
from .states import GraphHold


def _lent(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


class UnitResidency:
    def unshard(self) -> None:
        if self.unit is not None:
            apply_state_dict_writes_of([self], "unshard()")
            if self.unit.fp8_scales_stale:
                self.ctx.refresh_fp8_scales()
            self.unit.unshard()

    def wait_unshard(self) -> None:
        self._adopt_replaced(self.slots.use([], False), unsharded=True)

    def reshard(self) -> None:
        self._adopt_replaced(self.slots.release(False), unsharded=False)

    @property
    def keeps_params_unsharded(self) -> bool:
        """Strategies other than optim_grads_params keep the unsharded copy between uses."""
        return self.unit is not None and self.options.keeps_params_unsharded

    def release(self, keep_unsharded: bool = False, after_forward: bool = False) -> None:
        """Done with the unsharded parameters for now: the module's slots get the sharded
        ones back; the memory is freed unless the strategy keeps it (or `keep_unsharded`;
        the next use then gathers again only if the shards changed). A higher-order graph
        that reads the gathered parameters (GraphHold) keeps the memory too.
        `after_forward` (a backward follows): with reshard_after_forward=int the unit keeps
        this rank's 1/N of the gathered parameters for that backward's gather."""
        keep = keep_unsharded or self.keeps_params_unsharded or self.graph_hold is GraphHold.HELD
        keep_post_forward = after_forward and self.options.post_forward_shard_size > 0
        self._adopt_replaced(self.slots.release(keep, keep_post_forward), unsharded=False)

    def _adopt_replaced(self, replaced: List[int], unsharded: bool) -> None:
        """After the slots got the unsharded (or sharded) parameters: slots the user
        re-assigned since the last install (module.weight = nn.Parameter(...)) give their
        values to the unit, then the slots are installed again. A slot holding a tensor
        that is not an nn.Parameter was lent, not re-assigned (Module.__setattr__ refuses
        a plain tensor for a parameter; torch's stateless reparametrization, as in
        torch.func.functional_call, writes it into the module's dict for one call): it
        stays, the module computes with it, and torch puts ours back after the call."""
        if not replaced:
            return
        replaced = [k for k in replaced if not _lent(self.slots.params_dict(k).get(str(self.slots.name(k))))]
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
