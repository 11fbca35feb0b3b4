"""Lightning Fabric's ModelParallelStrategy with our fully_shard in its parallelize function:
fabric.save and fabric.load of a model and its optimizer, as a DCP checkpoint and as one
full file, resume the run exactly. Lightning finds the model of a checkpoint by asking
whether its parameters are DTensors (FSDP2's always are); before sharded_param's answer to
that check, both raised "Could not find a distributed model"."""
import pytest

from harness import run_distributed
from harness import lightning_workers as w


@pytest.mark.parametrize("distributed", [True, False], ids=["dcp", "full_file"])
def test_lightning_fabric_saves_and_resumes_a_model_sharded_by_ours(tmp_path, distributed):
    assert all(run_distributed(w.save_and_resume, 2, str(tmp_path), distributed, timeout=240))


def test_lightning_empty_init_materializes_our_units_as_a_plain_init():
    """Lightning materializes a module only if something in it is meta; our deferred shards
    are allocated, so they answer is_meta as FSDP2's meta parameters do until materialized."""
    assert all(run_distributed(w.empty_init_is_a_plain_init, 2, timeout=240))
