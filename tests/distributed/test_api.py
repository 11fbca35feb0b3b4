"""FSDPModule methods, state dicts and parameter replacement on Gloo."""
import pytest

from harness import run_distributed
from harness.workers import api_semantics, world_one_and_eval


@pytest.mark.parametrize("world", [2, 4])
def test_api_semantics(world):
    run_distributed(api_semantics, world, timeout=180)


@pytest.mark.parametrize("world", [1, 2])
def test_eval_forward_reshards(world):
    run_distributed(world_one_and_eval, world, timeout=180)
