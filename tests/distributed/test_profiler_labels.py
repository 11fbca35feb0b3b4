"""Profiler scopes name the unit and the phase: in a torch.profiler trace of one training
step every unit shows mfsdp::pre_forward / post_forward / pre_backward / post_backward
(Python hooks) and mfsdp::all_gather / reduce_scatter (C++ collectives) with its module
path, and the next block's prefetch all-gather sits inside the current block's pre-forward."""
import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import megatron_fsdp_ext as mfsdp
from harness import gpu_world, run_distributed


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _events(rank, world):
    torch.manual_seed(0)
    net = _Net()
    for b in net.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(net, gather_bucket_bytes=0, reduce_bucket_bytes=0)  # a label per unit
    x = torch.randn(4, 8)
    net(x).sum().backward()  # records the forward order: the next step prefetches
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        net(x).sum().backward()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.name.startswith("mfsdp::")]


def test_profiler_scopes_name_unit_and_phase():
    events = run_distributed(_events, 2, timeout=180)[0]
    names = {n for n, _, _ in events}
    for unit in ("blocks.0", "blocks.1", "blocks.2", "_Net (root)"):
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward", "all_gather",
                      "reduce_scatter"):
            assert f"mfsdp::{phase}[{unit}]" in names, (phase, unit, sorted(names))
    assert not any(n.startswith("mfsdp::all_reduce[") for n in names), "world 2 FSDP reduce-scatters"

    def spans(name):
        return [(s, e) for n, s, e in events if n == name]

    # Forward prefetch: blocks.1's all-gather is issued from blocks.0's pre-forward.
    (outer,) = spans("mfsdp::pre_forward[blocks.0]")
    gathers = spans("mfsdp::all_gather[blocks.1]")
    assert any(outer[0] <= s and e <= outer[1] for s, e in gathers), (outer, gathers)

    # After its backward a unit frees its gathered parameters before it packs and
    # reduce-scatters its gradients (as FSDP2 reshards before its reduce-scatter input
    # exists): the reduction's buffer never adds to the parameters' memory. The root keeps
    # its parameters from forward to backward, so it shows this best.
    for unit in ("blocks.0", "blocks.1", "blocks.2", "_Net (root)"):
        (post,) = spans(f"mfsdp::post_backward[{unit}]")
        (reduce,) = [s for s, _ in spans(f"mfsdp::reduce_scatter[{unit}]") if post[0] <= s <= post[1]]
        frees = [s for s, _ in spans(f"mfsdp::reshard[{unit}]") if post[0] <= s <= post[1]]
        assert frees and frees[0] < reduce, (unit, post, frees, reduce)


def _traced_step(rank, world, cuda):
    """One bf16 step of _Net under UnitTrace: (phase, kind, unit label) per event, in order,
    and the replayed peak of unsharded bytes against the units' own sizes."""
    from harness.observe import UnitTrace

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    net = _Net().to(device)
    # bf16 compute: even a world-1 unit gathers (casts) into its own unsharded buffer.
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for b in net.blocks:
        mfsdp.fully_shard(b, mp_policy=mp)
    # Per unit: the replay checks each unit's own gathers and frees.
    mfsdp.fully_shard(net, mp_policy=mp, gather_bucket_bytes=0, reduce_bucket_bytes=0)
    x = torch.randn(4, 8, device=device)
    net(x).float().sum().backward()  # names the units and records the forward order
    states = [net._fsdp_state] + [b._fsdp_state for b in net.blocks]
    with UnitTrace(states) as trace:
        with UnitTrace.phase("fwd"):
            out = net(x).float().sum()
        with UnitTrace.phase("bwd"):
            out.backward()
    peak = trace.max_unsharded(weight=lambda s: s.unit.unsharded_nbytes)
    sizes = {s.label: s.unit.unsharded_nbytes for s in states}
    return [(ph, kind, s.label) for ph, kind, s in trace.events], peak, sizes


def _check_traced_step(events, peak, sizes):
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    root = "_Net (root)"

    def of(phase, kind):
        return [label for ph, k, label in events if ph == phase and k == kind]

    assert all(ph in ("fwd", "bwd") for ph, _, _ in events), f"events outside the marked phases: {events}"
    # Forward: the root, then every block in order (each gathered once, the next one
    # prefetched); every block freed again after its forward (reshard_after_forward).
    assert of("fwd", "unshard") == [root] + blocks, events
    assert sorted(of("fwd", "reshard")) == blocks, events
    # Backward (autograd's threads on CUDA): blocks gathered last first, every unit freed.
    assert of("bwd", "unshard") == blocks[::-1], events
    assert sorted(of("bwd", "reshard")) == sorted(blocks + [root]), events
    # With prefetch depth 1: root + at most 2 blocks in forward, root + at most 3 in backward.
    block, whole_root = sizes["blocks.0"], sizes[root]
    assert block > 0 and whole_root > 0, sizes
    assert whole_root + block < peak["fwd"] <= whole_root + 2 * block, (peak, sizes)
    assert peak["bwd"] <= whole_root + 3 * block, (peak, sizes)


@pytest.mark.parametrize("world", [1, 2])
def test_unit_trace_replays_gathers_and_frees_by_phase(world):
    """tests/harness/observe.py, which the prefetch tests rely on, against the order the
    hooks must follow: it sees every gather and free, in order, in the right phase."""
    _check_traced_step(*run_distributed(_traced_step, world, False, timeout=180)[0])


@pytest.mark.gpu
def test_unit_trace_sees_backward_on_autograd_threads_under_nccl():
    _check_traced_step(*run_distributed(_traced_step, gpu_world(), True, backend="nccl", timeout=180)[0])
