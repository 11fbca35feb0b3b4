"""save_checkpoint(..., async_save=True) and the bounds of every save (Gloo, CPU):

- the state is copied before the call returns: training right after it changes nothing
  in the checkpoint, which equals a synchronous save of the same state;
- the next save and load_checkpoint wait for a save still writing;
- a write failing in the background raises on every rank from result(), or from the next
  save or load when no result() call reported it; the previous checkpoint stays;
- a rank stalled in its write holds the others at most the checkpoint timeout, then every
  rank raises naming it (synchronous and asynchronous saves);
- a save removes the temporary directories a killed save left beside its target.
"""
from harness import run_distributed
from harness.async_ckpt_workers import (async_save_keeps_values_at_save_time, failed_background_write,
                                        next_save_and_load_wait, stale_temporaries_removed, stalled_write_times_out)


def test_async_save_holds_the_values_at_save_time(tmp_path):
    assert run_distributed(async_save_keeps_values_at_save_time, 2, str(tmp_path), timeout=120) == [True] * 2


def test_async_save_holds_the_values_at_save_time_world4(tmp_path):
    assert run_distributed(async_save_keeps_values_at_save_time, 4, str(tmp_path), timeout=120) == [True] * 4


def test_next_save_and_load_wait_for_an_async_save(tmp_path):
    assert run_distributed(next_save_and_load_wait, 2, str(tmp_path), timeout=120) == [True] * 2


def test_failed_background_write_raises_on_every_rank(tmp_path):
    assert run_distributed(failed_background_write, 2, str(tmp_path / "ckpt"), timeout=120) == [True] * 2


def test_stale_temporaries_are_removed(tmp_path):
    assert run_distributed(stale_temporaries_removed, 2, str(tmp_path), timeout=120) == [True] * 2


def test_stalled_rank0_write_is_bounded_by_the_timeout(tmp_path):
    # Rank 0 decides the outcome: here the others give up on it themselves.
    run_distributed(stalled_write_times_out, 2, str(tmp_path / "ckpt"), 0, 2.0, False, timeout=60)


def test_stalled_async_write_is_bounded_by_the_timeout(tmp_path):
    # Rank 1 is the only other rank: rank 0 alone must give up on it.
    run_distributed(stalled_write_times_out, 2, str(tmp_path / "ckpt"), 1, 2.0, True, timeout=60)
