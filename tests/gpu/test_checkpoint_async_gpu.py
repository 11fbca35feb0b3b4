"""Asynchronous checkpoints of CUDA models on the GPU suite's backend: the staged copy
is taken into one page-locked arena (reused by the next save of the same shapes), the
checkpoint holds the values at save time while training goes on, and the next save or
load waits for it."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import async_ckpt_workers as w

pytestmark = pytest.mark.gpu
WORLD = gpu_world()
GPU = gpu_launch()


def test_async_save_holds_the_values_at_save_time_gpu(tmp_path):
    assert all(run_distributed(w.async_save_keeps_values_at_save_time, WORLD, str(tmp_path), **GPU,
                               timeout=240))


def test_next_save_and_load_wait_for_an_async_save_gpu(tmp_path):
    assert all(run_distributed(w.next_save_and_load_wait, WORLD, str(tmp_path), **GPU, timeout=240))


def test_async_staging_is_one_pinned_arena_reused_gpu(tmp_path):
    assert all(run_distributed(w.staging_is_pinned_and_reused, WORLD, str(tmp_path), **GPU, timeout=240))
