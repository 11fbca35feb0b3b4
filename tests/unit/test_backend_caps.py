"""The capability table the collectives decide by (csrc/backend.cpp): what each of torch's
backends can do, per device type, and what an unknown backend is allowed."""
import pytest
import torch

from megatron_fsdp_ext import _C
from megatron_fsdp_ext.backends import register_backend_capabilities

FIELDS = ("moves_data", "enqueues_on_stream", "flat_all_gather", "flat_reduce_scatter", "coalesced_all_gather",
          "coalesced_reduce_scatter", "uneven_lists", "all_to_all")


def caps(name, device):
    c = _C.known_backend_caps(name, torch.device(device))
    return {f: getattr(c, f) for f in FIELDS}


def test_nccl_runs_on_streams_with_every_collective():
    assert caps("nccl", "cuda") == dict.fromkeys(FIELDS, True)


def test_gloo_on_cuda_has_no_coalesced_all_gather():
    # Its coalesced all-gather hands CUDA pointers to the host algorithm (pytorch#152645:
    # SIGSEGV): units in a gather bucket must gather one by one there.
    cuda = caps("gloo", "cuda")
    assert not cuda["coalesced_all_gather"] and cuda["coalesced_reduce_scatter"]
    assert caps("gloo", "cpu")["coalesced_all_gather"]
    for device in ("cpu", "cuda"):
        c = caps("gloo", device)
        assert c["all_to_all"]
        # The host waits for Gloo; uneven lists are refused; flat collectives exist.
        assert c["moves_data"] and not c["enqueues_on_stream"] and not c["uneven_lists"]
        assert c["flat_all_gather"] and c["flat_reduce_scatter"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fake_moves_nothing(device):
    c = caps("fake", device)
    assert not c["moves_data"] and not c["uneven_lists"] and not c["all_to_all"]


def test_an_unknown_backend_gets_the_plain_collectives_only():
    c = caps("somebody_elses_backend", "cuda")
    assert c == {"moves_data": True, "enqueues_on_stream": False, "flat_all_gather": False,
                 "flat_reduce_scatter": False, "coalesced_all_gather": False, "coalesced_reduce_scatter": False,
                 "uneven_lists": False, "all_to_all": False}
    assert caps("nccl", "cpu") == c  # NCCL has no CPU path: nothing is assumed


def test_registered_capabilities_are_what_units_see():
    name = "test_registered_backend"
    register_backend_capabilities(name, "cuda", enqueues_on_stream=True, coalesced_all_gather=True)
    c = caps(name, "cuda")
    assert c["enqueues_on_stream"] and c["coalesced_all_gather"] and c["flat_all_gather"]
    assert not c["coalesced_reduce_scatter"]
    assert not caps(name, "cpu")["flat_all_gather"]  # per device type
    with pytest.raises(ValueError, match="device_type must be one of"):
        register_backend_capabilities(name, "tpu")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_backend_capabilities("", "cpu")
