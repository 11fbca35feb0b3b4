"""benchmarks/scaling.py: efficiency = tokens/s/GPU at world N over the reference world's."""
import json

import pytest
from harness.scripts import BENCH, load_benchmark


@pytest.fixture(scope="module")
def scaling():
    return load_benchmark("scaling")


def write(tmp_path, name, world, rows):
    path = tmp_path / name
    results = [{"config": c, "system": s, "step_s": t, "tokens_per_s_per_gpu": 1000 / t, "peak_mem_gib": 1.0}
               for c, s, t in rows]
    path.write_text(json.dumps({"meta": {"world": world}, "results": results}))
    return str(path)


def test_efficiency_is_per_gpu_throughput_ratio(scaling, tmp_path):
    ref = write(tmp_path, "w2.json", 2, [("1b", "mfsdp", 0.2), ("1b", "ddp", 0.25)])
    w4 = write(tmp_path, "w4.json", 4, [("1b", "mfsdp", 0.25), ("1b", "ddp", 0.25), ("8b", "mfsdp", 1.0)])
    rows = scaling.scaling_rows(ref, [w4])
    by = {(r["config"], r["system"]): r for r in rows}
    assert set(by) == {("1b", "mfsdp"), ("1b", "ddp")}  # 8b has no reference row
    assert by[("1b", "mfsdp")]["efficiency"] == pytest.approx(0.8)
    assert by[("1b", "ddp")]["efficiency"] == pytest.approx(1.0)
    table = scaling.markdown(rows)
    assert "efficiency vs 2 GPUs" in table and "| 1b | mfsdp | 4 | 250.0 |" in table


def test_bad_inputs_name_the_problem(scaling, tmp_path):
    ref = write(tmp_path, "w2.json", 2, [("1b", "mfsdp", 0.2)])
    same = write(tmp_path, "again.json", 2, [("1b", "mfsdp", 0.2)])
    with pytest.raises(ValueError, match="reference's world size"):
        scaling.scaling_rows(ref, [same])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="not a bench_train results.json"):
        scaling.scaling_rows(ref, [str(bad)])


def test_recorded_two_gpu_reference_loads(scaling):
    world, rows = scaling.load(str(BENCH / "data" / "train_world2_h200_runE.json"))
    assert world == 2 and ("8b_ish", "fsdp2") in rows
