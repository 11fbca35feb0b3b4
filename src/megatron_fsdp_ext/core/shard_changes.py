"""Everything that changes a unit's shards outside its own collectives, and what follows
from it. Each path ends in the one C++ entry point, `Unit.shard_changed`, which writes
the shard if needed and marks any gathered copy stale (the next use gathers again):

- an optimizer step: the shards changed in place (`mark_stepped`, from the optimizer's
  step post-hook; the optimizer's state dicts must also speak full shapes: `adopt`);
- `sharded_param.data = x`: found by the C++ unit itself at the parameter's next use
  (a pointer compare per parameter in `unshard`);
- `module.weight = nn.Parameter(full)`: found when the hooks put parameters back into
  the module (`ParamSlots.install`), handed over by `adopt_replaced_params`.

The first fully_shard registers one global step pre-hook. At an optimizer's first step it
adopts the optimizer if it holds sharded parameters (per-optimizer post-hook, state-dict
hooks) and records that it does not otherwise; every later step of either kind costs one
dict lookup. Optimizers of a process that never calls fully_shard see nothing."""
from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .extension_points import gather_transform
from .hook_support import load_dynamo, run_outside_dynamo
from .nonfinite import check_nonfinite_grads
from .param_index import conversion_refused, foreign_params, live_states
from .state_dict import (apply_optimizer_state_dict_writes, apply_state_dict_writes_of, attach_optimizer,
                         convert_loaded_optimizer_state, face_shape)

# optimizer.__dict__ key: (holds sharded parameters, number of param groups when checked)
_ADOPTED = "_mfsdp_adopted"
_registered = False


def ensure_step_hook_registered() -> None:
    """Called by fully_shard: from then on every optimizer's first step is checked. The
    hooks run eagerly under torch.compile of a step (a graph break, as the unit hooks):
    they keep Python state (Dynamo cannot trace writes into the optimizer's __dict__)."""
    global _registered
    if not _registered:
        load_dynamo()
        register_optimizer_step_pre_hook(run_outside_dynamo(_step_pre_hook))
        _registered = True


def _step_pre_hook(optimizer, args, kwargs) -> None:
    seen = optimizer.__dict__.get(_ADOPTED)
    # add_param_group may bring sharded parameters to an optimizer checked before.
    if seen is None or seen[1] != len(optimizer.param_groups):
        seen = (adopt(optimizer),)
    if seen[0]:
        units = _units_of(optimizer)
        states = [s for s in (owner() for owner, _ in units) if s is not None]
        for state in states:
            state.untag_grads()
        apply_state_dict_writes_of(states, f"{type(optimizer).__name__}.step()",
                                   may_change=None if _may_move_parameters(optimizer) else _has_nonzero_grad)
        apply_optimizer_state_dict_writes(optimizer, f"{type(optimizer).__name__}.step()")
        # units with check_for_nan_in_grad refuse the step on NaN/Inf gradients
        check_nonfinite_grads((owner() for owner, _ in units), f"{type(optimizer).__name__}.step()")


def _may_move_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """False where a step can change no parameter whatever the gradients hold: the
    optimizer has no state yet and every group's learning rate is 0 (torch's
    _init_optim_state, which get_optimizer_state_dict and set_optimizer_state_dict call;
    torch's optimizers scale every update by lr). The gradients are checked per unit
    (_has_nonzero_grad): Rprop's first step moves by its minimum step size otherwise."""
    if optimizer.state:
        return True
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if lr is None or (float(lr) if isinstance(lr, torch.Tensor) else lr) != 0:
            return True
    return False


def _has_nonzero_grad(state) -> bool:
    """Whether this rank's pieces of the unit's gradients hold anything but zeros."""
    for p in state.sharded_params:
        g = p.grad
        if g is not None and g.numel() and bool(g.detach().as_subclass(torch.Tensor).any()):
            return True
    return False


def adopt(optimizer: torch.optim.Optimizer) -> bool:
    """Link `optimizer` to the units whose sharded parameters it holds (idempotent):
    after each of its steps, their gathered copies are marked stale; its state_dict() and
    load_state_dict() use full shapes; state loaded before is cut to this rank's pieces.
    Returns whether it holds any sharded parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _refuse_replaced_params(optimizer, params)
    _refuse_params_added_to_units(optimizer, params)
    seen = optimizer.__dict__.get(_ADOPTED)
    was_ours = seen is not None and seen[0]
    ours = was_ours or any(getattr(p, "_mfsdp_owner", None) is not None for p in params)
    if ours:
        _refuse_whole_parameter_optimizers(optimizer)
    optimizer.__dict__[_ADOPTED] = (ours, len(optimizer.param_groups))
    if ours and not was_ours:
        convert_loaded_optimizer_state(optimizer)
        attach_optimizer(optimizer)
        optimizer.register_step_post_hook(run_outside_dynamo(lambda opt, args, kwargs: mark_stepped(opt)))
    return ours


def _refuse_params_added_to_units(optimizer: torch.optim.Optimizer, params) -> None:
    """A trainable parameter registered in a unit's modules after fully_shard (PEFT's
    add_adapter, load_adapter or add_weighted_adapter on the sharded model) is a plain
    tensor the unit does not know: not sharded, and its gradient never reduced across
    ranks, so every rank would step it with its own and the ranks would drift apart,
    silently (FSDP2's units leave such a parameter alone too). Refused at the first step
    of an optimizer holding one, on every rank (they build the same modules)."""
    candidates = {id(p): p for p in params if p.requires_grad and getattr(p, "_mfsdp_owner", None) is None
                  and not isinstance(p, DTensor)}  # TP / EP parameters are DTensors over the unit's pieces
    if not candidates:
        return
    for state in list(live_states):
        for name, _ in foreign_params(state, candidates):
            raise NotImplementedError(
                f"megatron_fsdp_ext: {type(optimizer).__name__} holds parameter '{name}' of {state}, which was "
                "added to the unit's modules after fully_shard (e.g. PEFT's add_adapter / load_adapter / "
                "add_weighted_adapter on the sharded model): it is not sharded and its gradient is not reduced "
                "across ranks, so each rank would step it differently. Add it before fully_shard (create every "
                "adapter, then shard), or train it outside the sharded model")


# Optimizers whose update needs a whole parameter, or every parameter's values at once,
# and would take each rank's piece for it (those this torch has), each with why.
_FACTORED = ("its row/column factoring of the second moment and its scaling by the parameter's RMS would see "
             "the piece, not the parameter")
_WHOLE_PARAMETER = {
    getattr(torch.optim, name): why for name, why in (
        ("Adafactor", _FACTORED),
        ("Muon", "its Newton-Schulz orthogonalization needs each matrix's whole gradient; for Muon use "
                 "megatron_fsdp_ext.layerwise.LayerwiseDistributedOptimizer on a replicated model"),
        ("LBFGS", "its dot products and convergence tests over all parameters would be each rank's own, so "
                  "ranks would take different steps and different numbers of closure calls"),
    ) if getattr(torch.optim, name, None) is not None
}


# The same kinds from other libraries, known by class name (their modules are not
# dependencies): each computes a norm, an RMS or a factoring of the whole parameter (a
# trust ratio ||p|| / ||update||: timm's and apex's LAMB and LARS; Hugging Face's and
# timm's Adafactor; Shampoo and SOAP's matrix preconditioners). On a piece those are each
# rank's own, silently (FSDP2's DTensors make them global, with a collective per op).
_TRUST_RATIO = "its trust ratio divides the norm of the whole parameter by that of its {}"
_WHOLE_PARAMETER_NAMES = {
    **dict.fromkeys(("Lamb", "LAMB", "FusedLAMB"), _TRUST_RATIO.format("update")),
    **dict.fromkeys(("Lars", "LARS", "FusedLARS"), _TRUST_RATIO.format("gradient")),
    "Adafactor": _FACTORED,
    "AdafactorBigVision": "its row/column factoring of the second moment would see the piece, not the parameter",
    **dict.fromkeys(("Shampoo", "DistributedShampoo", "SOAP"),
                    "its preconditioners are built from each whole gradient matrix"),
}


# torchao's low-bit Adams size their quantized state from the parameter's shape (blocks of
# the whole parameter, or full precision under 4096 elements) and step it with the
# gradient, here this rank's piece: they fail at their first step with a broadcast error
# from inside torchao (their DTensor path quantizes each rank's local shard instead).
_QUANTIZED_STATE_NAMES = frozenset(("Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8"))


def _refuse_whole_parameter_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that computes on a whole parameter (its shape, its RMS, its matrix) or
    on all parameters together would step each rank's piece as a different parameter:
    refused on every rank at its first step (FSDP2's DTensors fail on them too, or run
    them with a collective per op). torch's by class, other libraries' by class name."""
    for cls, why in _WHOLE_PARAMETER.items():
        if isinstance(optimizer, cls):
            raise NotImplementedError(
                f"megatron_fsdp_ext: {type(optimizer).__name__} holds fully_shard parameters, whose values are "
                f"each rank's 1-D piece of a parameter: {why}, and train differently. Use an elementwise "
                "optimizer (AdamW, SGD, ...) with fully_shard")
    named = next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in _WHOLE_PARAMETER_NAMES), None)
    if named is not None:
        raise NotImplementedError(
            f"megatron_fsdp_ext: {type(optimizer).__name__} ({type(optimizer).__module__}) holds fully_shard "
            f"parameters, whose values are each rank's 1-D piece of a parameter: as a {named} optimizer, "
            f"{_WHOLE_PARAMETER_NAMES[named]}, so each rank would compute it on its piece and train differently. "
            "Use an elementwise optimizer (AdamW, SGD, ...) with fully_shard")
    quantized = next((c.__name__ for c in type(optimizer).__mro__
                      if c.__name__ in _QUANTIZED_STATE_NAMES and c.__module__.startswith("torchao.")), None)
    if quantized is not None:
        raise NotImplementedError(
            f"megatron_fsdp_ext: {type(optimizer).__name__} ({type(optimizer).__module__}) holds fully_shard "
            f"parameters, whose values and gradients are each rank's 1-D piece of a parameter: torchao's "
            f"{quantized} sizes its quantized state from the whole parameter's shape and cannot step a piece. "
            "Use torch.optim.AdamW (fused=True), torchao.optim._AdamW (full-precision state, bf16 stochastic "
            "rounding) or megatron_fsdp_ext.optim.CPUAdamW with fully_shard")


# optimizer.__dict__ key: the units whose gather copy in host memory (offloaded units) the
# optimizer's last step wrote whole along with their shards (optim.CPUAdamW): marked fresh
# after their shard_changed(), so that their next gather copies it as it is.
COPIED_OUT = "_mfsdp_copied_out"

# optimizer.__dict__ key: (ids of its parameters, ((unit state ref, its parameters), ...))
_UNITS = "_mfsdp_units"


def _units_of(optimizer: torch.optim.Optimizer):
    """The units whose sharded parameters `optimizer` holds, each with those parameters;
    grouped once and again only when the optimizer's parameters change."""
    ids = list(map(id, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
    cached = optimizer.__dict__.get(_UNITS)
    if cached is not None and cached[0] == ids:
        return cached[1]
    by_state: dict = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = getattr(p, "_mfsdp_owner", None)
            if owner is not None:
                by_state.setdefault(id(owner()), (owner, []))[1].append(p)
    units = tuple((owner, tuple(params)) for owner, params in by_state.values())
    optimizer.__dict__[_UNITS] = (ids, units)
    return units


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """After optimizer.step(): the units' gradients get their ShardedGrad types back; any
    gathered copy of the units whose parameters it updated (those with a gradient) is
    stale, and their FP8 scales are recomputed: kept copies (optim, optim_grads, no_shard
    with a cast) and anything gathered before the step. Needed because fused
    optimizers change the shards without moving their version counters. Per unit, not
    per parameter: the first parameter with a gradient decides."""
    stepped = []
    for owner, params in _units_of(optimizer):
        state = owner()
        if state is None or state.unit is None:
            continue
        state.tag_grads(stepped=True)  # the step pre-hook made them plain for the optimizer's reads
        for p in params:
            if p.grad is not None:
                state.unit.shard_changed()
                stepped.append(state.unit)
                break
    for unit in optimizer.__dict__.pop(COPIED_OUT, ()):
        unit.mark_host_copy_fresh()
    # FP8 gathers: the new shards' scales, one all-reduce(max) for all, right after the
    # step as torchao's precompute_float8_dynamic_scale_for_fsdp does.
    gather_transform().refresh_units(stepped)


def _refuse_replaced_params(optimizer, params) -> None:
    """An optimizer built from model.parameters() before fully_shard holds the original
    parameters, which fully_shard replaced: its steps would change nothing the model
    uses (the loss stays flat). fully_shard marks those originals."""
    replaced = [p for p in params if getattr(p, "_mfsdp_replaced", False)]
    if replaced:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {len(replaced)} parameter(s) that fully_shard replaced by sharded "
            f"ones (the first has shape {tuple(replaced[0].shape)}): it was built before fully_shard, so its "
            "steps would not change the model. Build the optimizer after fully_shard, from model.parameters()."
        )


def adopt_replaced_params(state, replaced_slots) -> None:
    """The user assigned new parameters to module slots of `state`'s unit
    (module.weight = nn.Parameter(...)): each rank keeps its slice of the new value in its
    shard (no communication), and the slot gets the sharded parameter back. A replacement
    of another shape raises, naming the parameter. Every rank must make the same
    replacement: the unit's next use gathers again."""
    for slot in replaced_slots:
        index = state.slots.param_index(slot)
        params_dict, name = state.slots.params_dict(slot), str(state.slots.name(slot))
        what = f"parameter '{state.names[index]}' of {state}"
        if name not in params_dict:
            # `del module.weight`, or a reparametrization that moved it (decided by the
            # module's slots, alike on every rank).
            raise ValueError(
                f"{what} was removed from its module (its slot '{name}' is gone): a unit gathers its parameters "
                "into their own slots only. Remove or reparametrize parameters before fully_shard")
        new = params_dict[name]
        if not isinstance(new, torch.Tensor):
            raise ValueError(f"{what} was replaced by a {type(new).__name__}, not a tensor")
        owner = getattr(new, "_mfsdp_owner", None)
        if owner is not None:
            # Another unit's (or this unit's) sharded parameter: its values are a piece of
            # that parameter, and a tie made now would not survive the next step.
            raise ValueError(
                f"{what} was replaced by a sharded parameter of {owner() or 'another fully_shard unit'}: "
                "parameters tied after fully_shard are not supported; tie them before fully_shard, "
                "with the tied modules in one unit (e.g. fully_shard([embedding, lm_head]) or the root)")
        value = new.detach()
        sharded = state.unit.sharded_param(index)
        if value.dtype != sharded.dtype or value.device != sharded.device:
            # A plain module inside the unit moved (.cpu(), .to("meta"): nn.Module._apply
            # replaces a parameter it cannot convert in place, with the piece converted) or a
            # value of another dtype: the unit would copy it into its flat buffer, silently
            # undoing the change.
            raise conversion_refused(state.unit.label, sharded, value.dtype, value.device)
        shape = tuple(face_shape(state, index))
        if tuple(value.shape) != shape:
            # Decided by the full shape, the same on every rank (a value the length of one
            # rank's piece is no exception).
            raise ValueError(
                f"{what} was replaced by one of shape {tuple(value.shape)}, but the parameter's shape is "
                f"{shape}; a replacement must keep the shape (or build the model again before fully_shard)")
        set_full_value(state, index, value)
        # The replacement's requires_grad is the user's word on training it (the unsharded
        # parameter follows the sharded one at its next install).
        if sharded.requires_grad != new.requires_grad:
            sharded.requires_grad_(new.requires_grad)
        params_dict[name] = sharded


def set_full_value(state, index: int, value: torch.Tensor) -> None:
    """The one way a value given in a parameter's full shape (a load, a replaced
    parameter) becomes this rank's shard: a tensor-parallel parameter's value is cut to
    this rank's TP shard first (tensor_parallel.py), then the unit keeps its slice."""
    tp = state.tp
    if tp is not None and index in tp.specs:
        value = tp.local_value(index, value)
    state.unit.shard_changed(index, value)
