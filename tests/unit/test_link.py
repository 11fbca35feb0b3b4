"""The "auto" bucket budget's arithmetic (megatron_fsdp_ext.link): the alpha-beta fit
through two timed all-gathers, and the budget at which the fixed cost is at most
LATENCY_SHARE of a bucket's collective."""
import math

import pytest

from megatron_fsdp_ext import link
from megatron_fsdp_ext.link import LinkModel, auto_bucket_bytes


def test_fit_recovers_alpha_and_bandwidth():
    truth = LinkModel(alpha_s=20e-6, bytes_per_s=100e9)
    small, large = 64 << 10, 8 << 20
    fitted = LinkModel.fit((small, truth.seconds(small)), (large, truth.seconds(large)))
    assert fitted.alpha_s == pytest.approx(20e-6, rel=1e-9)
    assert fitted.bytes_per_s == pytest.approx(100e9, rel=1e-9)


def test_fit_without_a_measurable_bandwidth_cost_is_an_infinitely_fast_link():
    # torch's fake backend: both probes take the same few microseconds.
    fitted = LinkModel.fit((64 << 10, 5e-6), (8 << 20, 6e-6))
    assert math.isinf(fitted.bytes_per_s) and fitted.alpha_s == 5e-6
    assert auto_bucket_bytes(fitted) == 0
    with pytest.raises(ValueError, match="must exceed"):
        LinkModel.fit((8 << 20, 1.0), (64 << 10, 2.0))


def test_budget_makes_the_fixed_cost_at_most_the_latency_share_of_a_bucket():
    for alpha, beta in [(20e-6, 100e9), (30e-6, 150e9), (500e-6, 1e9), (3e-3, 50e6)]:
        model = LinkModel(alpha, beta)
        budget = auto_bucket_bytes(model)
        assert budget & (budget - 1) == 0  # a power of two
        if budget < link.MAX_AUTO_BUCKET_BYTES:
            # A full bucket's collective is at most 10% fixed cost ...
            assert alpha <= link.LATENCY_SHARE * model.seconds(budget) * (1 + 1e-12)
            # ... and half of it would not be (the smallest power of two that is).
            assert alpha > link.LATENCY_SHARE * model.seconds(budget // 2)
    # NVLink-like: 20 us at 100 GB/s needs 18 MB, so 32 MiB.
    assert auto_bucket_bytes(LinkModel(20e-6, 100e9)) == 32 << 20


def test_budget_is_bounded_and_zero_without_latency():
    assert auto_bucket_bytes(LinkModel(1.0, 1e12)) == link.MAX_AUTO_BUCKET_BYTES
    assert auto_bucket_bytes(LinkModel(0.0, 1e9)) == 0
    assert auto_bucket_bytes(LinkModel(1e-12, 1e9)) == 0  # below one byte
