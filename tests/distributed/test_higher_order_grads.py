"""Higher-order gradients (a gradient penalty: autograd.grad with create_graph=True, then
backward through both graphs) train as on one plain process; backward(create_graph=True)
into the parameters is refused by name (tests/harness/higher_order_workers.py)."""
import pytest

from harness import higher_order_workers as w
from harness import run_distributed


@pytest.mark.parametrize("mode", ["per_unit", "no_reshard", "bucketed", "forward_after", "metric_first"])
def test_gradient_penalty_trains_like_plain_pytorch(mode):
    assert run_distributed(w.gradient_penalty, 2, mode, timeout=150) == [True, True]


def test_gradient_penalty_at_world_4():
    assert run_distributed(w.gradient_penalty, 4, "forward_after", timeout=180) == [True] * 4


def test_backward_with_create_graph_into_parameters_is_refused():
    assert run_distributed(w.create_graph_into_parameters_is_refused, 2, timeout=120) == [True, True]
