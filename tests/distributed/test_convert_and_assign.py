"""What Hugging Face Accelerate's FSDP2 path does to a sharded model, against FSDP2 doing
the same: a dtype change after fully_shard (module.to(dtype), .half(), .double(): the
units are rebuilt in the new dtype, the parameter objects kept), state_dict() of a model
sharded on the meta device (FSDP2's meta DTensors) and load_state_dict(assign=True) (the
values written into the unit's parameters). Torch's own calls first, then Accelerate's
own code with ours patched in for torch's fully_shard."""
import functools

import pytest
import torch

from harness import run_distributed
from harness.convert_workers import (CONVERSIONS, accelerate_fsdp2_prepare, dtype_change_after_fully_shard,
                                     dtype_changes_refused, meta_state_dict_and_assign)


@pytest.mark.parametrize("case", sorted(CONVERSIONS))
def test_dtype_change_after_fully_shard_trains_like_fsdp2(case):
    run_distributed(dtype_change_after_fully_shard, 2, case, timeout=180)


def test_dtype_changes_a_unit_cannot_take_are_refused():
    run_distributed(dtype_changes_refused, 2, timeout=120)


@pytest.mark.parametrize("world", [2, 3])
def test_meta_state_dict_and_assign_load_like_fsdp2(world):
    run_distributed(meta_state_dict_and_assign, world, timeout=180)


@pytest.mark.parametrize("case,tie", [("upcast", False), ("ram_efficient", True)])
def test_accelerate_fsdp2_path_trains_like_fsdp2(case, tie):
    pytest.importorskip("accelerate", reason="Accelerate's FSDP2 path needs accelerate (test extra)")
    pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (test extra)")
    ours = run_distributed(accelerate_fsdp2_prepare, 2, "ours", case, tie, timeout=300)
    theirs = run_distributed(accelerate_fsdp2_prepare, 2, "fsdp2", case, tie, timeout=300)
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for step, (la, lb) in enumerate(zip(a["losses"], b["losses"])):
            close(torch.tensor(la), torch.tensor(lb), msg=lambda m: f"rank {rank} step {step} loss: {m}")
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga.keys() == gb.keys()
            for name in ga:
                close(torch.tensor(ga[name]), torch.tensor(gb[name]),
                      msg=lambda m: f"rank {rank} step {step} grad '{name}': {m}")
    sa, sb = ours[0]["state_dict"], theirs[0]["state_dict"]
    assert sa.keys() == sb.keys()
    for key in sa:
        close(torch.tensor(sa[key]), torch.tensor(sb[key]), msg=lambda m: f"'{key}': {m}")
