"""A Hugging Face mixture-of-experts model sharded with fully_shard trains as one plain
PyTorch process on the whole batch: losses, every parameter's gradient (before each
optimizer step) and every parameter (after it), for three AdamW steps with weight decay.

Why: Hugging Face's MoE blocks run only the experts some local token was routed to, so on
data-parallel ranks with different tokens an expert is in some ranks' autograd graphs
only. Its reduced gradient must land on every rank, the one holding its piece without
having used it included (Unit::agree_on_grads); before that, that rank kept `.grad =
None` and AdamW skipped the piece (no update, no weight decay), which the gradient and
parameter checks here catch. The workers assert that the first step really has experts
reached on some ranks only and (SwitchTransformers, whose experts are modules of their
own) a rank holding a piece of such an expert's parameter with no local gradient for it,
so the test cannot silently stop exercising the case. Mixtral's experts are fused 3-D
parameters in transformers 5.x (zero rows, never a missing gradient): trained as the
common decoder-only case."""
import pytest

from harness import run_distributed
from harness import hf_moe_workers as w

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")


@pytest.mark.parametrize("arch,world", [("switch", 2), ("switch", 3), ("mixtral", 2)])
def test_hf_moe_trains_like_one_process(arch, world):
    out = run_distributed(w.trains_like_one_process, world, arch, timeout=240)[0]
    assert max(out["worst"].values()) < w.TOL, out
    assert out["partly_reached_experts"], out
    if arch == "switch":
        assert out["lacked_local_grad"], out
