"""torch.compile on sharded models, against plain PyTorch (eager, single process):
`block.compile(fullgraph=True)` after fully_shard traces each block with no graph break
(the unit hooks run eagerly, outside the graph, as FSDP2's do) and trains with parity,
gradients included; compiling the whole model with torch.compile also trains with parity."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.testing import run_distributed
from megatron_fsdp_ext.testing.workers import gather_full_grads


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _build():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(16, 4))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_training(rank, world, mode):
    torch._dynamo.reset()
    ref, model = _build(), _build()
    for block in list(model)[:3]:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    if mode == "blocks_fullgraph":
        for block in list(model)[:3]:
            block.compile(fullgraph=True, backend="aot_eager")
        run = model
    else:
        run = torch.compile(model, backend="aot_eager")
    counters.clear()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per = 8 // world
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        run(x[rank * per:(rank + 1) * per]).pow(2).mean().backward()
        full = mfsdp.full_state_dict(model, rank0_only=False)  # parameters, before the step
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-6)
        grads = gather_full_grads(model, replicated=False)  # flattened, placed by each unit's layout
        for name, g in _grads(ref).items():
            torch.testing.assert_close(grads[name], g.reshape(-1), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    if mode == "blocks_fullgraph":
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 1
    return True


@pytest.mark.parametrize("mode", ["blocks_fullgraph", "whole_model"])
def test_compile_after_fully_shard_matches_eager_pytorch(mode):
    assert run_distributed(_compiled_training, 2, mode, timeout=240) == [True, True]
