"""Layer-wise optimizer on NCCL: parity and gather/forward overlap."""
import pytest

from megatron_fsdp_ext.testing import run_distributed
from megatron_fsdp_ext.testing import workers as W

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", [True, False])
def test_nccl_layerwise_muon_parity(overlap):
    run_distributed(W.layerwise_parity, 2, {"overlap": overlap}, backend="nccl", timeout=300)


def test_nccl_layerwise_gather_overlaps_forward():
    run_distributed(W.layerwise_gather_overlap, 2, backend="nccl", timeout=300)
