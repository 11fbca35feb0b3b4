"""Lightning Fabric's ModelParallelStrategy with our fully_shard in its parallelize function:
fabric.save and fabric.load of a model and its optimizer, as a DCP checkpoint and as one
full file, resume the run exactly. Lightning finds the model of a checkpoint by asking
whether its parameters are DTensors (FSDP2's always are); before sharded_param's answer to
that check, both raised "Could not find a distributed model".

Lightning's Trainer (ModelParallelStrategy, ours in the LightningModule's configure_model)
at world 2: fit trains as with FSDP2 and as one plain process on the global batches; a
ModelCheckpoint (DCP folder or one full file) resumes through fit(ckpt_path=) bit for bit
as the uninterrupted run; trainer.init_module(empty_init=True) gives a plain Net()'s values
and the same training. With tensor parallelism (dp 2 x tp 2, world 4) Fabric's empty_init
gives the TP model alone's values and training with its clip matches one process. Each
rank runs inside run_distributed's Gloo group: torchrun's
environment makes Lightning join it and launch nothing."""
import pytest

from harness import run_distributed
from harness import lightning_trainer_workers as tw
from harness import lightning_workers as w


@pytest.mark.parametrize("distributed", [True, False], ids=["dcp", "full_file"])
def test_lightning_fabric_saves_and_resumes_a_model_sharded_by_ours(tmp_path, distributed):
    assert all(run_distributed(w.save_and_resume, 2, str(tmp_path), distributed, timeout=240))


def test_lightning_empty_init_materializes_our_units_as_a_plain_init():
    """Lightning materializes a module only if something in it is meta; our deferred shards
    are allocated, so they answer is_meta as FSDP2's meta parameters do until materialized."""
    assert all(run_distributed(w.empty_init_is_a_plain_init, 2, timeout=240))


def test_lightning_trainer_fit_matches_fsdp2_and_a_plain_run(tmp_path):
    stats = run_distributed(tw.fit_matches_fsdp2_and_plain, 2, str(tmp_path), 3, timeout=240)
    assert all(s["steps"] == 3 * tw.STEPS_PER_EPOCH for s in stats), stats


@pytest.mark.parametrize("distributed", [True, False], ids=["dcp", "full_file"])
def test_lightning_trainer_resumes_from_a_checkpoint_as_the_uninterrupted_run(tmp_path, distributed):
    stats = run_distributed(tw.resume_matches_uninterrupted, 2, str(tmp_path), distributed, 3, timeout=240)
    assert all(s["steps_resumed"] == 2 * tw.STEPS_PER_EPOCH for s in stats), stats


def test_lightning_trainer_empty_init_materializes_a_plain_init_and_trains_alike(tmp_path):
    """FSDP2 is no reference here: its reset_parameters() under empty_init draws every
    rank's shard from the same generator state, so its values are not a plain Net()'s."""
    assert all(run_distributed(tw.empty_init_matches_plain_init, 2, str(tmp_path), 2, timeout=240))


def test_lightning_tensor_parallel_empty_init_and_training():
    """dp 2 x tp 2: Lightning's per-module to_empty on TP units (once left waiting for a
    load: the first forward refused them), then training with its clip as one process."""
    assert all(run_distributed(w.tensor_parallel_empty_init_and_training, 4, timeout=300))
