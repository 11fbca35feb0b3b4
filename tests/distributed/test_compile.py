"""torch.compile on sharded models, against plain PyTorch (eager, single process):
`block.compile(fullgraph=True)` after fully_shard traces each block with no graph break
(the unit hooks run eagerly, outside the graph, as FSDP2's do) and trains with parity,
gradients included; compiling the whole model with torch.compile trains with parity, its
graphs break only at the units' hooks, and the blocks' computation is compiled."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import megatron_fsdp_ext as mfsdp
from harness import drop_in_workers, run_distributed
from harness.workers import gather_full_grads


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


class _RecordingBackend:
    """aot_eager, keeping the ops of every graph Dynamo hands over."""

    def __init__(self):
        self.graph_ops = []

    def __call__(self, gm, example_inputs):
        self.graph_ops.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return aot_eager(gm, example_inputs)


def _compiled_training(rank, world, mode):
    torch._dynamo.reset()
    ref, model = _build(), _build()
    for block in list(model)[:3]:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    backend = _RecordingBackend()
    if mode == "blocks_fullgraph":
        for block in list(model)[:3]:
            block.compile(fullgraph=True, backend=backend)
        run = model
    else:
        run = torch.compile(model, backend=backend)
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
    else:
        # Dynamo stops only at the units' hooks (a break inside Sequential's loop makes it
        # run that frame eagerly and compile each block's frame: still at unit boundaries).
        assert counters["graph_break"], "the unit hooks should break the whole-model graph"
        for reason in counters["graph_break"]:
            assert "megatron_fsdp_ext unit hooks" in reason, f"graph break inside a unit: {reason}"
    # Each block's computation (layer_norm, the two linears, gelu) is in a compiled graph.
    assert counters["stats"]["unique_graphs"] >= 1
    assert any("gelu" in " ".join(ops) and "layer_norm" in " ".join(ops) for ops in backend.graph_ops), \
        backend.graph_ops
    return True


@pytest.mark.parametrize("mode", ["blocks_fullgraph", "whole_model"])
def test_compile_after_fully_shard_matches_eager_pytorch(mode):
    assert run_distributed(_compiled_training, 2, mode, timeout=240) == [True, True]


def _compiled_autograd_is_refused(_rank, world_size):
    """Compiled autograd cannot hold a unit's gathers and reductions (side effects of its
    hooks): the global switch is refused at the root's forward, by name; a backward run
    under compiled_autograd._enable fails at the post-backward marker. Neither trains."""
    model = _build()
    for block in model[:3]:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(model)
    x = torch.randn(4, 16)
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(NotImplementedError, match="do not support compiled autograd"):
            model(x)
    loss = model(x).sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        with pytest.raises(Exception, match="PostBackwardMarker"):
            loss.backward()
    assert all(p.grad is None for p in model.parameters()), "a refused backward left gradients"
    return True


def test_compiled_autograd_is_refused_by_name():
    assert run_distributed(_compiled_autograd_is_refused, 2, timeout=240) == [True, True]



def test_compiled_optimizer_step_over_sharded_parameters():
    assert run_distributed(drop_in_workers.compiled_optimizer_step, 2, "aot_eager", timeout=240) == [True, True]
