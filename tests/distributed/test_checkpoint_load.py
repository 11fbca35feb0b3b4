"""load_checkpoint reads each rank's pieces of the shards straight from the stored chunks
(checkpoint_pieces): no data moves between ranks for a model of plain parameters. Values
after resharding and across strategies: test_strategies.py; tensor-parallel models (read
as DTensors, then cut): test_tensor_parallel.py."""
from harness import run_distributed
from harness.ckpt_load_workers import load_reads_pieces_without_exchange


def test_load_reads_the_pieces_without_exchanging_rows(tmp_path):
    assert run_distributed(load_reads_pieces_without_exchange, 2, str(tmp_path / "ckpt"), timeout=120) == [True] * 2
