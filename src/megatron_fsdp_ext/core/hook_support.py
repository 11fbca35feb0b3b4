"""What the unit hooks share: running outside Dynamo, per-unit profiler scopes, the
walks over forward inputs and outputs, and the one point where gathers are issued."""
from __future__ import annotations

import dataclasses
import functools
import gc
import sys

import torch
import torch.autograd.profiler as autograd_profiler
from torch.utils._pytree import tree_flatten, tree_map


def load_dynamo() -> None:
    """Import torch._dynamo (run_outside_dynamo needs it) before a fully_shard call holds
    any parameter. Its first import leaves reference cycles through the frames on the
    stack, and a returned frame keeps its locals: left to the garbage collector, they would
    hold the first unit's unsharded originals (device memory) until it next runs. One
    collection right after that import frees them."""
    if "torch._dynamo" not in sys.modules:
        import torch._dynamo  # noqa: F401

        gc.collect()


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
        def run(self, *args, **kwargs):
            if not autograd_profiler._is_profiler_enabled:
                return method(self, *args, **kwargs)
            with torch.profiler.record_function(f"mfsdp::{phase}[{self.label}]"):
                return method(self, *args, **kwargs)
        return run
    return wrap


def _cast_if_floating(x, dtype: torch.dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def cast_floating(tree, dtype: torch.dtype):
    """Every floating-point tensor in `tree` cast to `dtype`; everything else as it is."""
    return tree_map(lambda x: _cast_if_floating(x, dtype), tree)


def cast_call_inputs(args: tuple, kwargs: dict, dtype: torch.dtype):
    """A forward call's (args, kwargs) with every floating-point tensor cast to `dtype`.
    The usual call (tensors and scalars, positionally) skips the pytree walk, which costs
    several times the casts' own dispatch once per unit and forward."""
    if not is_flat_call(args, kwargs):
        return cast_floating((args, kwargs), dtype)
    return tuple(_cast_if_floating(a, dtype) for a in args), kwargs


def same_type(marked: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """The marker's C++ view drops a subclass that only overrides __torch_function__
    (one with __torch_dispatch__, like DTensor, keeps its type): give it back, history kept."""
    return marked if type(marked) is type(original) else marked.as_subclass(type(original))


def units_to_gather(states) -> list:
    """The C++ units of `states`, in order (states without parameters have none), right
    before C++ gathers them (ParamSlots.use, Unit.unshard_all): the one Python step of
    every hook's gathers, where GPU tests inject stream delays."""
    return [s.unit for s in states if s.unit is not None]


def tensors_in(obj) -> list:
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
SCALAR_TYPES = (int, float, bool, str, type(None))
_FLAT_TYPES = (torch.Tensor, *SCALAR_TYPES)


def is_flat_call(args: tuple, kwargs: dict) -> bool:
    """Whether a forward call passes only tensors and scalars, and only positionally."""
    return not kwargs and all(isinstance(a, _FLAT_TYPES) for a in args)
