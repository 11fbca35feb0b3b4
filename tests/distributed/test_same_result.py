"""Same script, same result: scripts FSDP2 and one plain process train alike, where our
units once gave silently different gradients or crashed (issue 41's probe), each compared
step by step with one plain process on the whole batch (gradients of every parameter)."""
import pytest

from harness import run_distributed
from harness import same_result_workers as w


def test_unit_called_on_input_without_grad_then_again():
    """A shared Linear applied to the raw input and again to a hidden state: the first
    call's backward comes after the unit's reduction (its inputs needed no gradient, so no
    post-backward marker): gathered again and reduced again, not a step late."""
    worst = run_distributed(w.shared_on_raw_input, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


@pytest.mark.parametrize("buckets", [0, 1 << 20], ids=["per_unit", "reduce_buckets"])
def test_tied_embedding_in_a_unit_of_several_modules(buckets):
    """fully_shard([embed, norm, head]) with the head tied to the embedding: the lookup's
    gradient (token ids need none) is reduced in the same step."""
    worst = run_distributed(w.tied_embedding, 2, buckets, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst


def test_unit_returning_a_dataclass():
    """A unit whose forward returns a plain @dataclass: its outputs get the pre-backward
    hook (the unit is gathered for backward), as FSDP2 finds them."""
    worst = run_distributed(w.dataclass_output, 2, timeout=120)[0]
    assert worst["grad"] < 1e-5 and worst["loss"] < 1e-5, worst
