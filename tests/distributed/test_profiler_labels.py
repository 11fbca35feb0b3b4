"""Profiler scopes name the unit and the phase: in a torch.profiler trace of one training
step every unit shows mfsdp::pre_forward / post_forward / pre_backward / post_backward
(Python hooks) and mfsdp::all_gather / reduce_scatter (C++ collectives) with its module
path, and the next block's prefetch all-gather sits inside the current block's pre-forward."""
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import megatron_fsdp_ext as mfsdp
from harness import run_distributed


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
    mfsdp.fully_shard(net)
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
