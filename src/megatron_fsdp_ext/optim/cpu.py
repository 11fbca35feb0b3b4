"""CPU optimizers for offloaded units: CPUAdamW, CPUAdam and CPUSGD.

Each is a torch.optim.Optimizer (param groups, state dicts with torch's keys, hooks, LR
schedulers, DCP's optimizer helpers) whose step is one C++ call per param group
(csrc/cpu_optim.h): multithreaded, vectorized, one pass over memory. For the sharded
parameters of a unit offloaded in bf16 (CPUOffloadPolicy with param_dtype=bfloat16), the
same pass writes the bf16 copy the unit's next gather copies to the device as it is, and
the unit is told that copy is fresh (`shard_changes.mark_stepped`): the device then gets
half the bytes and casts nothing. The results are torch.optim.AdamW / Adam / SGD's, up to
float rounding; their state dicts load into each other.

They step float32 tensors in host memory only (any CPU model works, offloaded or not,
FSDP2's CPUOffloadPolicy included: a DTensor parameter is stepped through its local
tensor); a device parameter raises, naming it.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from .. import _C
from ..core.param_index import owner_of
from ..core.shard_changes import COPIED_OUT
from ..core.dtensor_face import is_dtensor


def set_num_threads(threads: int) -> None:
    """Threads of the CPU optimizers' steps (0: torch.get_num_threads())."""
    _C.set_cpu_optim_threads(int(threads))


def num_threads() -> int:
    return _C.cpu_optim_threads()


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """What the kernel writes: a DTensor's local tensor (FSDP2's sharded parameters), else the tensor."""
    return t.to_local() if is_dtensor(t) else t


def _check_float(name: str, value, low: float = 0.0, *, tensor_ok: bool = False) -> None:
    """A hyper-parameter: a number, or where torch takes a tensor too (`tensor_ok`: lr,
    betas, SGD's weight_decay) a one-element float tensor."""
    if isinstance(value, torch.Tensor):
        if not tensor_ok:
            raise TypeError(f"{name} must be a number, got a tensor")
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"Tensor {name} must be a one-element float tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        number = value.item()
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    else:
        number = value
    if not number >= low:
        raise ValueError(f"invalid {name}: {number}")


# What the kernel cannot give of torch's options, and why (refused when asked for).
_UNSUPPORTED = {
    "amsgrad": "the kernel keeps no running maximum of the second moment; use torch.optim for AMSGrad",
    "capturable": "it makes a step capturable in a CUDA graph, with the state on the device; this optimizer "
                  "steps host tensors in C++, outside any graph",
    "differentiable": "the C++ step runs outside autograd; use torch.optim to differentiate through a step",
}


def _check_torch_switches(optimizer: str, foreach, fused, **asked) -> None:
    """torch's implementation switches. foreach and fused pick among torch's own kernels
    (per-tensor loops, multi-tensor, fused) and change no result: the step here is always
    one fused, multithreaded C++ pass per param group, so any value is accepted and none
    changes it. The options in `asked` (amsgrad, capturable, differentiable) change what a
    step computes and are refused when True."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{optimizer}: {name} must be None or a bool, got {value!r}")
    if foreach and fused:
        raise ValueError(f"{optimizer}: fused=True and foreach=True cannot be set together (as in torch)")
    for name, value in asked.items():
        if not isinstance(value, bool):
            raise TypeError(f"{optimizer}: {name} must be a bool, got {value!r}")
        if value:
            raise ValueError(f"{optimizer}: {name}=True is not supported: {_UNSUPPORTED[name]}")


class _CPUOptimizer(torch.optim.Optimizer):
    """What the three share: the checks of each stepped tensor and the gather copy-out."""

    def _stepped(self, group) -> List[torch.Tensor]:
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                # The constructor's refusal, for a param group that a loaded state dict set.
                raise ValueError(f"{type(self).__name__}: {key}=True (e.g. from a loaded torch state dict) "
                                 "is not supported; use torch's optimizer for it")
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if p.device.type != "cpu" or p.grad.device.type != "cpu":
                raise RuntimeError(
                    f"{type(self).__name__} steps host tensors; a parameter of shape {tuple(p.shape)} (or its "
                    f"gradient) is on {p.device if p.device.type != 'cpu' else p.grad.device}. Offload its unit "
                    "(fully_shard(..., offload_policy=CPUOffloadPolicy())) or use a torch optimizer")
            if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                raise RuntimeError(f"{type(self).__name__} steps float32 master weights; a parameter of shape "
                                   f"{tuple(p.shape)} is {p.dtype} with a {p.grad.dtype} gradient")
            if not (_local(p).is_contiguous() and _local(p.grad).is_contiguous()):
                raise RuntimeError(f"{type(self).__name__} steps contiguous tensors; a parameter of shape "
                                   f"{tuple(p.shape)} (or its gradient) is not")
            params.append(p)
        return params

    def _copy_outs(self, owners: list, units: dict) -> List[Optional[torch.Tensor]]:
        """Per parameter (`owners`: its (unit or None, index)), its slice of its unit's bf16
        gather copy (None: not offloaded with one); `units` collects, per unit, the indices
        of its parameters written."""
        outs = []
        for unit, index in owners:
            copy = unit.host_gather_copy if unit is not None and unit.offloaded else None
            if copy is None:
                outs.append(None)
                continue
            spec = unit.param_spec(index)
            outs.append(copy.narrow(0, spec.slice.shard_offset, spec.slice.numel))
            units.setdefault(id(unit), [unit, set()])[1].add(index)
        return outs

    def _report_copied_out(self, units: dict) -> None:
        whole = []
        for unit, written in units.values():
            needed = {i for i, spec in enumerate(unit.param_specs) if spec.slice.numel > 0}
            if needed <= written:
                whole.append(unit)
        self.__dict__[COPIED_OUT] = whole

    @staticmethod
    def _owners(params: List[torch.Tensor]) -> list:
        """(unit or None, index in it) of each parameter, looked up once per step."""
        out = []
        for p in params:
            state, index = owner_of(p)
            out.append((state.unit if state is not None else None, index))
        return out

    def _closure_loss(self, closure: Optional[Callable]):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class CPUAdamW(_CPUOptimizer):
    """torch.optim.AdamW for float32 parameters in host memory, stepped by one C++ pass per
    param group on num_threads() threads (csrc/cpu_optim.h). Same arguments, defaults and
    state (`step`, `exp_avg`, `exp_avg_sq`) as torch's. lr may be a one-element tensor, read
    at every step (an LR scheduler fills a tensor lr in place); tensor betas are read once,
    as torch reads them. foreach and fused are accepted and change nothing: they choose
    among torch's kernels, and this step is always one fused host pass. amsgrad=True,
    capturable=True (CUDA graphs; these parameters are on the host) and differentiable=True
    raise ValueError. step(grad_scale=s) reads every gradient times `s` in the same pass (an
    unscale or clipping coefficient, without a pass of its own).

    overlap_step=True: step() hands each fully_shard unit's update to a background thread,
    in the order the parameters are listed (model.parameters(): the order units are
    gathered in), and returns. The next forward then gathers unit k as soon as its update
    is done, while the host still steps the units after it. Every library path that reads
    or writes a shard or its gradient waits for its unit's update first (the gather, the
    next backward's landing, state dicts, checkpoints, clip_grad_norm_), as do this
    optimizer's state_dict(), load_state_dict(), next step() and zero_grad(set_to_none=False)
    (set_to_none=True only drops references: the updates hold their own); code of your own
    that reads the parameters between step() and the next forward calls synchronize() first.
    Parameters outside any unit are stepped before step() returns."""

    _decoupled = True
    _mfsdp_state_kind = "AdamW"  # checkpoints move between this and torch.optim.AdamW (dcp_flat)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, overlap_step: bool = False):
        if not isinstance(overlap_step, bool):
            raise TypeError(f"overlap_step must be a bool, got {overlap_step!r}")
        self.overlap_step = overlap_step
        self._pending: list = []  # HostTasks of the last overlapped step
        self._queue = _C.HostTaskQueue() if overlap_step else None
        _check_torch_switches(type(self).__name__, foreach, fused, amsgrad=amsgrad, capturable=capturable,
                              differentiable=differentiable)
        _check_float("lr", lr, tensor_ok=True)
        _check_float("eps", eps)
        _check_float("weight_decay", weight_decay)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(f"betas must be a pair of floats, got {betas!r}")
        for i, b in enumerate(betas):
            _check_float(f"beta parameter at index {i}", b, tensor_ok=True)
            if not float(b) < 1.0:
                raise ValueError(f"invalid beta parameter at index {i}: {float(b)}")
        betas = tuple(float(b) for b in betas)  # as torch keeps them: numbers, read once
        # torch's keys, so that state dicts and checkpoints move between the two; the
        # options this kernel does not have keep their off values (checked at each step).
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                                      maximize=bool(maximize), foreach=foreach, capturable=False,
                                      differentiable=False, fused=fused, decoupled_weight_decay=self._decoupled))

    def __getstate__(self):
        # copy.deepcopy and torch.save: the hyper-parameters and state (torch's), not the
        # background thread or the updates in flight (waited for first).
        self.synchronize()
        state = super().__getstate__()
        state.pop("_pending", None)
        state.pop("_queue", None)
        state["overlap_step"] = self.overlap_step
        return state

    def __setstate__(self, state) -> None:
        state = dict(state)
        self.overlap_step = bool(state.pop("overlap_step", False))
        self._pending = []
        self._queue = _C.HostTaskQueue() if self.overlap_step else None
        super().__setstate__(state)

    def synchronize(self) -> None:
        """Wait until the last step's overlapped updates are done (a no-op without overlap_step)."""
        pending, self._pending = self._pending, []
        for task in pending:
            task.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroing in place would race the updates still reading them
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, *, grad_scale: float = 1.0):
        loss = self._closure_loss(closure)
        self.synchronize()
        units: dict = {}
        by_unit: dict = {}  # overlap_step: per unit (first listed first), its (group, tensors) segments
        for group in self.param_groups:
            params = self._stepped(group)
            if not params:
                continue
            exp_avgs, exp_avg_sqs, steps = [], [], []
            for p in params:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(int(state["step"].item()))
            beta1, beta2 = group["betas"]
            hyper = _C.AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                 eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                 decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                                 maximize=bool(group["maximize"]))
            owners = self._owners(params)
            tensors = ([_local(p) for p in params], [_local(p.grad) for p in params],
                       [_local(t) for t in exp_avgs], [_local(t) for t in exp_avg_sqs],
                       self._copy_outs(owners, units), steps)
            if self.overlap_step:
                for i, (unit, _) in enumerate(owners):
                    segments = by_unit.setdefault(id(unit), (unit, {}))[1]
                    segment = segments.setdefault(id(group), ([], [], [], [], [], [], hyper))
                    for column, values in zip(segment, tensors):
                        column.append(values[i])
            else:
                _C.adam_step(*tensors, hyper, float(grad_scale))
        for unit, segments in by_unit.values():
            if unit is None:  # parameters outside any unit: nothing would wait for them
                for seg in segments.values():
                    _C.adam_step(*seg, float(grad_scale))
                continue
            task = self._queue.submit_adam_steps(list(segments.values()), float(grad_scale),
                                                 f"{type(self).__name__}.step() of unit '{unit.label}'")
            unit.set_host_update(task)
            self._pending.append(task)
        self._report_copied_out(units)
        return loss


class CPUAdam(CPUAdamW):
    """torch.optim.Adam (weight decay as an L2 term of the gradient, or decoupled as AdamW's
    with decoupled_weight_decay=True) on the CPUAdamW kernel; torch's arguments, taken as
    CPUAdamW takes them."""

    _decoupled = False
    _mfsdp_state_kind = "Adam"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: Optional[bool] = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, decoupled_weight_decay: bool = False):
        if not isinstance(decoupled_weight_decay, bool):
            raise TypeError(f"decoupled_weight_decay must be a bool, got {decoupled_weight_decay!r}")
        self._decoupled = decoupled_weight_decay
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)


class CPUSGD(_CPUOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay, maximize) for float32
    host parameters, one C++ pass per param group; state `momentum_buffer` as torch's.
    torch's arguments, taken as CPUAdamW takes them (lr and weight_decay may be one-element
    tensors; foreach and fused change nothing; differentiable=True raises ValueError)."""

    _mfsdp_state_kind = "SGD"

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None):
        _check_torch_switches(type(self).__name__, foreach, fused, differentiable=differentiable)
        _check_float("lr", lr, tensor_ok=True)
        _check_float("momentum", momentum)
        _check_float("weight_decay", weight_decay, tensor_ok=True)
        _check_float("dampening", dampening, low=float("-inf"))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=bool(nesterov), maximize=bool(maximize), foreach=foreach,
                                      differentiable=False, fused=fused))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, *, grad_scale: float = 1.0):
        loss = self._closure_loss(closure)
        units: dict = {}
        for group in self.param_groups:
            params = self._stepped(group)
            if not params:
                continue
            momentum = float(group["momentum"])
            buffers, first = [], []
            for p in params:
                if momentum == 0.0:
                    continue
                state = self.state[p]
                new = state.get("momentum_buffer") is None
                if new:
                    state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
                first.append(new)
            hyper = _C.SgdHyper(lr=float(group["lr"]), momentum=momentum, dampening=float(group["dampening"]),
                                weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                                maximize=bool(group["maximize"]))
            _C.sgd_step([_local(p) for p in params], [_local(p.grad) for p in params], [_local(t) for t in buffers],
                        self._copy_outs(self._owners(params), units), first, hyper, float(grad_scale))
        self._report_copied_out(units)
        return loss
