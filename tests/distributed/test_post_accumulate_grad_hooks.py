"""Post-accumulate-grad hooks on sharded parameters run once the reduced gradient has
landed, as FSDP2 runs them after its reduce-scatter: optimizer-in-backward trains as on
one plain process (per unit, in a reduce bucket, after accumulation without sync), and a
hook's error fails the backward (tests/harness/grad_hook_workers.py)."""
import pytest

from harness import grad_hook_workers as w
from harness import run_distributed


@pytest.mark.parametrize("mode", ["per_unit", "bucketed", "accumulate"])
@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_in_backward_trains_like_plain_pytorch(mode, world):
    run_distributed(w.optimizer_in_backward, world, mode, timeout=180)


def test_a_hook_error_fails_the_backward_and_training_goes_on():
    assert run_distributed(w.hook_error_propagates, 2, timeout=120) == [True, True]
