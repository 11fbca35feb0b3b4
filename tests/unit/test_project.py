"""benchmarks/project.py: the link fitted to a probe, a system's own collective counts, and
the check against measured steps."""
import json

import pytest
from harness.scripts import load_benchmark


@pytest.fixture(scope="module")
def project():
    return load_benchmark("project")


def probe(tmp_path, world, alpha_ms, busbw_gbps):
    """A link_probe.py JSON whose timed all-gathers follow alpha + B (W-1)/W / busbw exactly."""
    checks = [{"bytes": b, "measured_s": (alpha_ms + b * (world - 1) / world / (busbw_gbps * 1e9) * 1e3) / 1e3}
              for b in (1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"meta": {"world": world}, "checks": checks}))
    return str(path)


def test_fit_probe_recovers_the_link(project, tmp_path):
    fit = project.fit_probe(probe(tmp_path, 4, 0.04, 300.0))
    for kind in ("all_gather", "reduce_scatter"):
        alpha, busbw = fit[kind]
        assert alpha == pytest.approx(0.04, rel=1e-6)
        assert busbw == pytest.approx(300.0, rel=1e-6)
    # And a collective costs what the fitted line says at another size.
    ms = project.collective_ms("all_gather", 256 << 20, 4, fit)
    assert ms == pytest.approx(0.04 + (256 << 20) * 0.75 / 300e9 * 1e3, rel=1e-6)


def row(system, config="1b", world=4, fwd=50.0, bwd=100.0, counts=None):
    r = {"system": system, "config": config, "world": world, "forward_ms": fwd, "backward_ms": bwd,
         "step_ms": fwd + bwd + 5.0}
    if counts:
        r["our_counts_per_step"] = {"all_gather": [counts[0], 0], "reduce_scatter": [counts[1], 0]}
    return r


def test_buckets_mean_fewer_larger_collectives(project, tmp_path):
    link = project.fit_probe(probe(tmp_path, 4, 0.5, 300.0))  # a slow start: counts matter
    layers = project.unit_sizes("1b")[2]
    per_unit = project.project(row("mfsdp"), nvlink=link)
    assert (per_unit["gathers_per_phase"], per_unit["reduce_scatters"]) == (layers, layers)
    # 4 buckets a phase: 2 * 4 gathers + the root's two, 4 reduce-scatters + the root's.
    bucketed = project.project(row("mfsdp", counts=(10, 5)), nvlink=link)
    assert (bucketed["gathers_per_phase"], bucketed["reduce_scatters"]) == (4, 4)
    assert bucketed["all_gather_ms_each"] > per_unit["all_gather_ms_each"]
    # The same bytes in 4 collectives instead of 24 pay 20 fewer latencies in backward,
    # where (with this compute) the communication is exposed.
    slow = project.project(row("mfsdp", bwd=1.0), nvlink=link)
    slow_bucketed = project.project(row("mfsdp", bwd=1.0, counts=(10, 5)), nvlink=link)
    assert slow_bucketed["exposed_backward_ms"] < slow["exposed_backward_ms"]
    # Compute long enough hides everything but the last reduce-scatter and the root's.
    hidden = project.project(row("mfsdp", bwd=10_000.0, fwd=10_000.0), nvlink=link)
    rs_root = project.collective_ms("reduce_scatter", project.unit_sizes("1b")[0] * 4, 4, link)
    assert hidden["exposed_backward_ms"] == pytest.approx(hidden["reduce_scatter_ms_each"] + rs_root)


def test_the_gradient_agreement_costs_a_latency_per_reduction(project, tmp_path):
    """Rows whose counts show ours's all-reduce of the gradient flags pay one more link
    latency per reduce-scatter; the exposed last reduction and the root's pay it once each."""
    link = project.fit_probe(probe(tmp_path, 4, 0.5, 300.0))
    plain = row("mfsdp", bwd=10_000.0, fwd=10_000.0, counts=(48, 25))
    agreed = dict(plain, our_counts_per_step=dict(plain["our_counts_per_step"], all_reduce=[25, 0]))
    without, with_masks = project.project(plain, nvlink=link), project.project(agreed, nvlink=link)
    assert with_masks["reduce_scatter_ms_each"] == pytest.approx(without["reduce_scatter_ms_each"] + 0.5)
    assert with_masks["exposed_backward_ms"] == pytest.approx(without["exposed_backward_ms"] + 2 * 0.5)


def test_measured_steps_are_read_from_each_format(project, tmp_path):
    compare_rows = tmp_path / "rows.json"  # compare_systems: rows without a world
    compare_rows.write_text(json.dumps([{"system": "mfsdp", "config": "1b", "step_s": 0.2, "round": 0},
                                        {"system": "mfsdp", "config": "1b", "step_s": 0.3, "round": 1},
                                        {"system": "fsdp2", "config": "1b", "error": "timed out"}]))
    ab = tmp_path / "ab.json"  # ab_train: {"runs": {name: results.json}}
    ab.write_text(json.dumps({"runs": {"new_1": {"meta": {"world": 4}, "results": [
        {"system": "mfsdp", "config": "13b", "step_s": 0.36}]}}}))
    found = project.load_measured([str(compare_rows), str(ab)], default_world=4)
    assert found == {("mfsdp", "1b", 4): [200.0, 300.0], ("mfsdp", "13b", 4): [360.0]}
    # Without a default world, rows that do not say theirs cannot match a projection.
    assert ("mfsdp", "1b", 4) not in project.load_measured([str(compare_rows)])


def test_collectives_take_their_sms_from_the_compute_beside_them(project, tmp_path):
    """The compute a collective runs beside loses the collective's share of the SMs: the
    projected step grows by that share of the communication hidden (no more than the
    compute it hides behind), and by nothing with the share at 0."""
    link = project.fit_probe(probe(tmp_path, 4, 0.04, 300.0))
    off = project.project(row("mfsdp"), nvlink=link, sm_share=0.0)
    assert off["compute_lost_to_comm_sms_ms"] == 0.0
    assert off["projected_step_ms"] == pytest.approx(
        off["measured_compute_ms"] + off["exposed_forward_ms"] + off["exposed_backward_ms"])
    # Long compute hides every collective but the first gather and the last reductions.
    long = project.project(row("mfsdp", fwd=10_000.0, bwd=10_000.0), nvlink=link, sm_share=0.25)
    n_ag, n_rs = long["gathers_per_phase"], long["reduce_scatters"]
    ag, rs = long["all_gather_ms_each"], long["reduce_scatter_ms_each"]
    hidden = (n_ag - 1) * ag + (n_ag - 1) * ag + (n_rs - 1) * rs
    assert long["compute_lost_to_comm_sms_ms"] == pytest.approx(0.25 * hidden)
    # Short compute: only the compute there is can be slowed, and the slowed compute
    # hides that much more of the link's time: a phase bound by the link does not grow.
    short = project.project(row("mfsdp", fwd=1.0, bwd=1.0), nvlink=link, sm_share=0.25)
    short_off = project.project(row("mfsdp", fwd=1.0, bwd=1.0), nvlink=link, sm_share=0.0)
    lost = 0.25 * (1.0 * (n_ag - 1) / n_ag + 1.0 * (n_rs - 1) / n_rs)
    assert short["compute_lost_to_comm_sms_ms"] == pytest.approx(lost)
    assert short["exposed_forward_ms"] + short["exposed_backward_ms"] == pytest.approx(
        short_off["exposed_forward_ms"] + short_off["exposed_backward_ms"] - lost)
    assert short["projected_step_ms"] == pytest.approx(short_off["projected_step_ms"])
