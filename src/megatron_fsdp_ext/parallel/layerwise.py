"""Layer-wise distributed optimizer: every parameter has one owner rank that runs the
optimizer on it whole (Muon, Shampoo, ... need whole matrices); the updated
parameters reach the other ranks by an uneven all-gather (all-gather-v) per bucket,
optionally overlapped with the next forward.

The model stays replicated (no fully_shard): each rank computes local gradients;
step() reduce-scatters them so that each parameter's averaged gradient lands on its
owner (reduce_scatter_v), the owners step, and the buckets are all-gathered back.
Parameters are views of their bucket's flat buffer, so a gather writes them in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C
from ..core.hook_support import run_outside_dynamo
from ..core.dtensor_face import is_dtensor

OptimizerFactory = Callable[[List[nn.Parameter]], Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]]


def numel_cost(p: torch.Tensor) -> float:
    return float(p.numel())


def newton_schulz_cost(p: torch.Tensor) -> float:
    """Muon's orthogonalisation costs ~ m * n * min(m, n) per step for an m x n matrix."""
    if p.dim() < 2:
        return float(p.numel())
    m, n = p.shape[0], p[0].numel()
    return float(m) * n * min(m, n)


@dataclass
class OwnerBucket:
    """Parameters stored in one flat buffer, each segment updated by its owner rank."""
    index: int
    params: List[nn.Parameter]
    names: List[str]
    layout: object  # _C.FlatLayout (owner segments)
    flat: torch.Tensor  # the parameters' storage
    started: bool = False
    done: bool = True
    pending: Optional[object] = None  # _C.PendingCollective of the gather in flight
    # Ranks build the layout from their own parameter list: the first collective checks
    # that every rank's segment table agrees (one small all-gather); later ones skip it.
    verified: bool = False

    def owned(self, rank: int) -> List[int]:
        return [i for i in range(len(self.params)) if self.layout.owner(i) == rank]


def build_owner_buckets(named, bucket_size: int, cost_fn, alignment: int, world: int) -> List[OwnerBucket]:
    """Consecutive parameters (same dtype and device) in buckets of at most `bucket_size`
    elements, each balanced over the ranks by `cost_fn` from what earlier buckets gave
    them; every parameter becomes a view of its bucket's flat buffer."""
    groups, cur, cur_numel = [], [], 0
    for n, p in named:
        if getattr(p, "_mfsdp_owner", None) is not None:
            raise ValueError(f"parameter '{n}' is sharded by fully_shard; the layer-wise optimizer takes replicated parameters")
        if is_dtensor(p):
            raise NotImplementedError(
                f"parameter '{n}' is a DTensor placed {tuple(p.placements)} on mesh {p.device_mesh.mesh_dim_names} "
                "(tensor parallel); the layer-wise optimizer takes plain replicated parameters: use fully_shard "
                "with a torch optimizer for tensor-parallel models")
        if cur and (cur_numel + p.numel() > bucket_size or p.dtype != cur[0][1].dtype or p.device != cur[0][1].device):
            groups.append(cur)
            cur, cur_numel = [], 0
        cur.append((n, p))
        cur_numel += p.numel()
    if cur:
        groups.append(cur)
    buckets, loads = [], []
    for k, group in enumerate(groups):
        names = [n for n, _ in group]
        params = [p for _, p in group]
        # Balance within the bucket, starting from what earlier buckets assigned.
        owners, loads = _C.balance_owners([float(cost_fn(p)) for p in params], world, loads)
        layout = _C.FlatLayout.by_owner([p.numel() for p in params], owners, world, alignment)
        flat = torch.zeros(layout.total_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for i, p in enumerate(params):
                view = flat[layout.offsets[i]: layout.offsets[i] + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the parameter now lives in the bucket: gathers write it in place
        buckets.append(OwnerBucket(k, params, names, layout, flat))
    return buckets


class BucketGather:
    """The all-gather-v of each bucket back from its owners after a step, in bucket order:
    launched ahead (on the C++ side stream on CUDA) and finished by forward pre-hooks
    right before a bucket is used, or all at once."""

    def __init__(self, buckets: List[OwnerBucket], comm, rank: int, gather_algo):
        self.buckets = buckets
        self.comm, self.rank, self.gather_algo = comm, rank, gather_algo
        # The C++ side streams and events (one all-gather stream; none on CPU, where a
        # gather completes when issued).
        self._ctx = _C.CommContext(buckets[0].flat.device)
        self._hooks = []

    def install_forward_hooks(self, model: nn.Module, bucket_of: Dict[int, tuple]) -> None:
        """Each module with parameters waits, before its forward, for the last bucket they live in."""
        for module in model.modules():
            direct = [p for p in module.parameters(recurse=False) if id(p) in bucket_of]
            if not direct:
                continue
            last = max(bucket_of[id(p)][0].index for p in direct)
            self._hooks.append(module.register_forward_pre_hook(
                run_outside_dynamo(lambda m, args, b=last: self.finish(b))))

    def remove_hooks(self) -> None:
        self.finish_all()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reset(self) -> None:
        """The owners stepped: every bucket must be gathered again."""
        for b in self.buckets:
            b.started, b.done = False, False

    def start(self, index: int) -> None:
        """Launch bucket `index`'s all-gather-v (on a side stream on CUDA)."""
        if index >= len(self.buckets):
            return
        b = self.buckets[index]
        if b.started or b.done:
            return
        b.started = True
        lay = b.layout
        mine = b.flat.narrow(0, lay.segment_starts[self.rank], lay.segment_numels[self.rank])
        verify, b.verified = not b.verified, True
        # Ordered after the owners' updates already queued on the current stream.
        b.pending = self._ctx.all_gather_v_async(self.comm, b.flat, mine, list(lay.segment_starts),
                                                 list(lay.segment_numels), self.gather_algo, verify=verify)

    def finish(self, index: int) -> None:
        """Make bucket `index` (and every earlier one) usable, then launch the next."""
        if index >= len(self.buckets) or self.buckets[index].done:
            return
        for k in range(index + 1):
            b = self.buckets[k]
            if b.done:
                continue
            self.start(k)
            if b.pending is not None:
                b.pending.wait()
                b.pending = None
            b.done = True
        self.start(index + 1)

    def finish_all(self) -> None:
        self.finish(len(self.buckets) - 1)


class LayerwiseDistributedOptimizer:
    """Wrap any torch.optim optimizer(s) so that each parameter is updated by one rank.

    params_or_model: an nn.Module (preferred: parameter names for checkpoints, and
        forward pre-hooks that finish each bucket's gather right before it is needed)
        or an iterable of parameters / (name, parameter) pairs.
    optimizer_factory: called once with the parameters this rank owns (possibly
        empty); returns an optimizer, a list of optimizers (e.g. Muon for 2-D weights
        and AdamW for the rest), or None.
    bucket_size: elements per bucket (parameters in registration order, which for
        usual models is forward order, so the first bucket needed is gathered first).
    overlap_param_gather: step() launches the gathers and returns; forward pre-hooks
        wait for the bucket they need and launch the next. False: gather inside step().
    cost_fn: owner balancing cost per parameter (default numel; newton_schulz_cost for Muon).
    grad_reduce: "reduce_scatter" (reduce_scatter_v, each owner gets its averaged
        grads) or "all_reduce" (fallback).
    """

    def __init__(
        self,
        params_or_model: Union[nn.Module, Iterable],
        optimizer_factory: OptimizerFactory,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_size: int = 40_000_000,
        overlap_param_gather: bool = True,
        cost_fn: Callable[[torch.Tensor], float] = numel_cost,
        grad_reduce: str = "reduce_scatter",
        alignment: int = _C.DEFAULT_ALIGNMENT,
        gather_algo: str = "AUTO",
    ):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("LayerwiseDistributedOptimizer needs torch.distributed.init_process_group() first")
        if grad_reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"grad_reduce must be 'reduce_scatter' or 'all_reduce', got {grad_reduce!r}")
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive int (elements), got {bucket_size!r}")
        if not hasattr(_C.VarAlgo, gather_algo):
            raise ValueError(f"gather_algo must be one of AUTO, GROUPED, PADDED; got {gather_algo!r}")
        self.process_group = process_group or dist.distributed_c10d._get_default_group()
        self.comm = _C.Communicator(self.process_group)
        self.rank, self.world = self.comm.rank, self.comm.size
        # Overlap needs forward pre-hooks to finish the gathers, hence a model.
        self.overlap_param_gather = overlap_param_gather and isinstance(params_or_model, nn.Module)
        self.grad_reduce = grad_reduce
        self.gather_algo = getattr(_C.VarAlgo, gather_algo)
        self.model = params_or_model if isinstance(params_or_model, nn.Module) else None

        named = self._named_params(params_or_model)
        if not named:
            raise ValueError("LayerwiseDistributedOptimizer got no parameters that require grad")
        self.buckets = build_owner_buckets(named, bucket_size, cost_fn, alignment, self.world)
        self._owner_of: Dict[int, tuple] = {}
        owned: List[nn.Parameter] = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._owner_of[id(p)] = (b, i)
                if b.layout.owner(i) == self.rank:
                    owned.append(p)
        self.owned_params = owned
        made = optimizer_factory(owned)
        self.optimizers: List[torch.optim.Optimizer] = (
            [] if made is None else list(made) if isinstance(made, (list, tuple)) else [made])
        owned_ids = {id(p) for p in owned}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in owned_ids:
                        raise ValueError("optimizer_factory must only use the parameters it was given (this rank's)")
        self.gather = BucketGather(self.buckets, self.comm, self.rank, self.gather_algo)
        if self.overlap_param_gather and self.model is not None:
            self.gather.install_forward_hooks(self.model, self._owner_of)

    # ------------------------------------------------------------ construction

    @staticmethod
    def _named_params(src) -> List[tuple]:
        if isinstance(src, nn.Module):
            items = list(src.named_parameters())
        else:
            items = []
            for k, x in enumerate(src):
                items.append(x if isinstance(x, tuple) else (f"param_{k}", x))
        return [(n, p) for n, p in items if p.requires_grad]

    # ------------------------------------------------------------ gradient reduction + step

    def _used_anywhere(self) -> List[List[bool]]:
        """Per bucket and parameter, whether some rank has its gradient: one all-reduce of
        a flag per parameter. A parameter used on some ranks only (a rank-dependent branch)
        gets its gradient on its owner as in one process over the whole batch, also where
        the owner itself did not use it."""
        counts = [len(b.params) for b in self.buckets]
        flags = torch.tensor([p.grad is not None for b in self.buckets for p in b.params], dtype=torch.int32,
                             device=self.buckets[0].flat.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        flat = (flags > 0).tolist()
        out, start = [], 0
        for n in counts:
            out.append(flat[start:start + n])
            start += n
        return out

    def _reduce_grads(self) -> None:
        scale = 1.0 / self.world
        for b, used in zip(self.buckets, self._used_anywhere()):
            lay = b.layout
            grads = [p.grad for p in b.params]
            flat_grad = torch.empty(lay.total_numel, dtype=b.flat.dtype, device=b.flat.device)
            _C.pack_into_flat(flat_grad, grads, list(lay.offsets), False, True)
            mine_start, mine_numel = lay.segment_starts[self.rank], lay.segment_numels[self.rank]
            if self.grad_reduce == "all_reduce":
                self.comm.all_reduce_sum(flat_grad)
                reduced = flat_grad.narrow(0, mine_start, mine_numel)
            else:
                reduced = torch.empty(mine_numel, dtype=flat_grad.dtype, device=flat_grad.device)
                self.comm.reduce_scatter_v(reduced, flat_grad, list(lay.segment_starts), list(lay.segment_numels),
                                           verify=not b.verified)
                b.verified = True
            reduced.mul_(scale)
            for i in b.owned(self.rank):
                p = b.params[i]
                if not used[i]:  # used on no rank: stays None, as in one process
                    continue
                off = lay.offsets[i] - mine_start
                p.grad = reduced[off: off + p.numel()].view_as(p)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("LayerwiseDistributedOptimizer.step does not take a closure")
        self.finish_all()  # a bucket whose forward never ran must not be gathered twice
        self._reduce_grads()
        for opt in self.optimizers:
            opt.step()
        self.gather.reset()
        if self.overlap_param_gather:
            self.start_param_sync(0)
        else:
            self.finish_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            for p in b.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    # ------------------------------------------------------------ checkpoints

    def _name_of(self) -> Dict[int, str]:
        return {id(p): n for b in self.buckets for p, n in zip(b.params, b.names)}

    def state_dict(self) -> dict:
        """Optimizer state of every parameter keyed by parameter name (gathered from the
        owners; collective), independent of the owner assignment."""
        names = self._name_of()
        local = {names[id(p)]: {} for p in self.owned_params}  # stateless params too
        for opt in self.optimizers:
            for p, st in opt.state.items():
                local[names[id(p)]] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, local, group=self.process_group)
        merged = {}
        for part in gathered:
            merged.update(part)
        return {"state": merged}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict() saved at any world size: each rank takes its owned names."""
        state = state_dict.get("state")
        if not isinstance(state, dict):
            raise KeyError("layer-wise optimizer state dict needs a 'state' entry")
        names = self._name_of()
        known = set(names.values())
        unexpected = sorted(set(state) - known)
        if unexpected:
            raise KeyError(f"optimizer state has unknown parameter names {unexpected[:5]}")
        for opt in self.optimizers:
            # Re-key by this optimizer's own parameter indices and let torch's loader
            # place/cast every entry (e.g. 'step' on device for fused/capturable).
            own = opt.state_dict()
            index_state, index = {}, 0
            for group in opt.param_groups:
                for p in group["params"]:
                    name = names[id(p)]
                    if name not in state:
                        raise KeyError(f"optimizer state is missing parameter '{name}'")
                    if state[name]:  # {}: the parameter had no state (e.g. plain SGD)
                        index_state[index] = state[name]
                    index += 1
            opt.load_state_dict({"state": index_state, "param_groups": own["param_groups"]})

    # ------------------------------------------------------------ parameter gather (BucketGather)

    def start_param_sync(self, index: int) -> None:
        """Launch bucket `index`'s all-gather-v (on a side stream on CUDA)."""
        self.gather.start(index)

    def finish_param_sync(self, index: int) -> None:
        """Make bucket `index` (and every earlier one) usable, then launch the next."""
        self.gather.finish(index)

    def finish_all(self) -> None:
        self.gather.finish_all()

    def remove_hooks(self) -> None:
        """Stop finishing gathers in forward hooks: from now on step() gathers itself."""
        self.gather.remove_hooks()
        self.overlap_param_gather = False
