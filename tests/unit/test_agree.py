"""agree.Agreement in one process (no torch.distributed): the block's own exception comes
back as itself, checks outrank failures, nothing is swallowed. The multi-rank contract
(every rank raises alike) is tests/distributed/test_agree.py."""
import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_fsdp_ext.core import agree
from megatron_fsdp_ext.core.agree import Agreement


class Refused(RuntimeError):
    pass


@pytest.fixture
def gathers(monkeypatch):
    """Every gather_objects call the helper makes, as (obj, group)."""
    calls = []
    real = agree.gather_objects

    def counting(obj, group=None):
        calls.append((obj, group))
        return real(obj, group)

    monkeypatch.setattr(agree, "gather_objects", counting)
    return calls


def test_no_failure_goes_on_with_every_share(gathers):
    assert not dist.is_initialized()
    with Agreement("step", share="mine") as step:
        pass
    assert step.shared == {0: "mine"}
    assert len(gathers) == 1


def test_own_exception_comes_back_as_itself(gathers):
    err = KeyError("the key 'w' is missing")
    with pytest.raises(KeyError) as info:
        with Agreement("load", error=Refused, tail="; nothing was loaded"):
            raise err
    assert info.value is err  # same object: type, message and traceback of the failed check
    assert not getattr(err, "__notes__", None)  # no other rank failed: nothing to add
    assert len(gathers) == 1 and gathers[0][0][0] == {0: "KeyError: \"the key 'w' is missing\""}


def test_checkpoint_exception_becomes_error_naming_its_ranks():
    dcp_failure = CheckpointException("load", {1: (OSError("disk gone"), None)})
    with pytest.raises(Refused, match=r"save: failed on rank\(s\) \[1\]: rank 1: OSError: disk gone; tail") as info:
        with Agreement("save", error=Refused, tail="; tail"):
            raise dcp_failure
    assert info.value.__cause__ is dcp_failure


def test_share_callable_reads_what_the_block_left_even_when_it_failed():
    seen = []
    filled = {}
    with pytest.raises(ValueError):
        with Agreement("fill", share=lambda: sorted(filled), check=lambda shared, _: seen.append(shared)):
            filled["a"] = 1
            raise ValueError("half way")
    assert seen == [{0: ["a"]}]


def test_share_set_in_the_block():
    with Agreement("files") as step:
        step.share = ["x.distcp"]
    assert step.shared == {0: ["x.distcp"]}


def test_check_outranks_the_failure():
    def refuse(shared, group):
        raise Refused(f"shares {shared}")

    with pytest.raises(Refused, match=r"shares \{0: 7\}"):
        with Agreement("step", share=7, check=refuse):
            raise ValueError("mine")


def test_fail_replaces_raise_agreed():
    got = []
    err = OSError("write failed")

    def fail(failed, own):
        got.append((failed, own))
        raise Refused("aborted")

    with pytest.raises(Refused, match="aborted"):
        with Agreement("write", fail=fail):
            raise err
    assert got == [({0: "OSError: write failed"}, err)]


def test_no_group_agrees_on_nothing(gathers):
    err = ValueError("local")
    with pytest.raises(ValueError) as info:
        with Agreement("keys", group=[]):
            raise err
    assert info.value is err and gathers == []
    with Agreement("keys", group=[]) as step:
        pass
    assert step.shared == {} and gathers == []


def test_several_groups_one_gather_each(gathers):
    with Agreement("keys", group=[None, None], share=1) as step:
        pass
    assert [g for _, g in gathers] == [None, None] and step.shared == {0: 1}


def test_keyboard_interrupt_is_not_agreed_on(gathers):
    with pytest.raises(KeyboardInterrupt):
        with Agreement("step"):
            raise KeyboardInterrupt
    assert gathers == []
