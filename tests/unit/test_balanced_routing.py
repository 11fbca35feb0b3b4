"""benchmarks/moe_setup.balanced_routing: the fixed routing the fake-backend simulator gives
every system (its gathered router weights hold no values)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_fsdp_ext.models import MoEConfig, MoEModel
from harness.scripts import load_benchmark


@pytest.fixture(scope="module")
def moe_setup():
    return load_benchmark("moe_setup")


def tiny(experts=8, top_k=2):
    torch.manual_seed(0)
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=16,
                    n_experts=experts, top_k=top_k, expert_hidden=16)
    return MoEModel(cfg)


def routed_pairs(model):
    """Per MoE layer, the (token, choice) -> expert choice its router made in the last forward."""
    seen, top_k = [], model.cfg.top_k
    for block in model.blocks:
        block.moe.router.register_forward_hook(
            lambda m, a, out: seen.append(torch.softmax(out.float(), -1).topk(top_k, -1).indices))
    return seen


@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 1), (6, 4)])
def test_every_pair_is_kept_and_every_expert_gets_its_share(moe_setup, experts, top_k):
    model = tiny(experts, top_k)
    moe_setup.balanced_routing(model)
    seen = routed_pairs(model)
    tokens = torch.randint(0, 64, (3, 16))
    model(tokens)
    n = tokens.numel()
    expected = (torch.arange(n)[:, None] * top_k + torch.arange(top_k)) % experts
    assert len(seen) == len(model.blocks)
    for chosen in seen:
        assert torch.equal(chosen, expected)  # the pattern, in order of preference
        flat = chosen.reshape(-1)
        place = (torch.cumsum(F.one_hot(flat, experts), 0) - 1).gather(1, flat[:, None]).squeeze(1)
        assert bool((place < model.cfg.capacity(n)).all()), "a pair was dropped"
        counts = torch.bincount(flat, minlength=experts)
        assert int(counts.max() - counts.min()) <= 1


def test_the_router_still_gets_its_gradient_and_the_routing_ignores_its_weights(moe_setup):
    a, b = tiny(), tiny()
    with torch.no_grad():  # b's routers would route otherwise
        for block in b.blocks:
            block.moe.router.weight.mul_(-3.0)
    for m in (a, b):
        moe_setup.balanced_routing(m)
    tokens = torch.randint(0, 64, (2, 16))
    seen_a, seen_b = routed_pairs(a), routed_pairs(b)
    a(tokens).float().pow(2).mean().backward()
    b(tokens)
    for x, y in zip(seen_a, seen_b):
        assert torch.equal(x, y)
    for block in a.blocks:
        grad = block.moe.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0
