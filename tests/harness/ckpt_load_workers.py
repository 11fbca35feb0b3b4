"""Workers of tests/distributed/test_checkpoint_load.py: how load_checkpoint reads."""
from __future__ import annotations

from megatron_fsdp_ext.core import state_dict as state_dict_module
from megatron_fsdp_ext.dcp import load_checkpoint, save_checkpoint

from .async_ckpt_workers import TINY, assert_same, model_and_optimizer, snapshot, train_step

# Rows of 24 elements: at world 2 a rank's range of the MLP weight starts and ends mid-row,
# so its pieces are partial rows around whole ones.
ODD_ROWS = dict(TINY, d_model=24)

def load_reads_pieces_without_exchange(rank, world, path):
    """A load into units of plain parameters reads each rank's pieces of the shards
    directly (partial rows included): no state-dict value goes through the exchange of
    rows (neither to make the targets nor to cut what was read), and the model and
    optimizer get exactly what was saved."""
    model, opt = model_and_optimizer(dims=ODD_ROWS)
    train_step(model, opt, 0)
    save_checkpoint(path, model, opt)
    saved = snapshot(model, opt)
    fresh, fresh_opt = model_and_optimizer(seed=7, dims=ODD_ROWS)
    train_step(fresh, fresh_opt, 5)
    calls = {"rows_as_dtensor": 0, "piece_of": 0}
    originals = {name: getattr(state_dict_module, f"_{name}") for name in calls}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return wrapper

    for name in calls:
        setattr(state_dict_module, f"_{name}", counting(name))
    try:
        load_checkpoint(path, fresh, fresh_opt)
    finally:
        for name, original in originals.items():
            setattr(state_dict_module, f"_{name}", original)
    assert calls == {"rows_as_dtensor": 0, "piece_of": 0}, f"the load exchanged rows: {calls}"
    assert_same(snapshot(fresh, fresh_opt), saved, "the loaded model and optimizer")
    return True
