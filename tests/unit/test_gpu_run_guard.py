"""A GPU run cannot pass empty: tests/conftest.py turns a skipped `gpu` test into a
failure under MFSDP_REQUIRE_GPU=1, tests/gpu/run_all.sh stops at once when it sees fewer
GPUs than MFSDP_GPU_WORLD, and tests/gpu/summarize_run.py fails a run with a skipped,
failed or missing GPU test. Run here with every GPU hidden (CUDA_VISIBLE_DEVICES="")."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_TEST = "tests/gpu/test_nccl.py::test_cuda_device_errors"


def load_summarizer():
    spec = importlib.util.spec_from_file_location("summarize_run", REPO / "tests/gpu/summarize_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def without_gpus(**extra):
    import megatron_fsdp_ext

    # The child imports the package from where this process found it: the install (CI,
    # where the source tree has no compiled _C) or a development checkout on PYTHONPATH.
    package_root = str(Path(megatron_fsdp_ext.__file__).resolve().parents[1])
    # (and not this pytest's own xdist worker variables: the child is a run of its own)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MFSDP_REQUIRE_GPU", "MFSDP_GPU_WORLD", "MFSDP_GPU_BACKEND", "MFSDP_COMMIT")
           and not k.startswith("PYTEST_XDIST_")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=package_root, **extra)
    return env


def run_pytest(tmp_path, env, *tests, xdist=("-p", "no:xdist")):
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", *(tests or (GPU_TEST,)), "-p", "no:cacheprovider",
                           *xdist, f"--junitxml={junit}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, load_summarizer().read_junit(junit)


def test_skipped_gpu_test_fails_when_gpus_are_required(tmp_path):
    # (Without MFSDP_REQUIRE_GPU the same test is skipped: every CPU run of the suite shows it.)
    proc, counts = run_pytest(tmp_path, without_gpus(MFSDP_REQUIRE_GPU="1"))
    assert proc.returncode == 1, proc.stdout[-2000:]
    # The skip happens in setup, so junit records the failure as an error.
    assert counts["failed"] + counts["errors"] == ["tests.gpu.test_nccl::test_cuda_device_errors"], counts
    assert not counts["skipped"] and counts["passed"] == 0
    assert "MFSDP_REQUIRE_GPU=1: this gpu test did not run (needs 2 CUDA GPUs for 2 ranks on nccl, found 0)" \
        in proc.stdout


NCCL_ONLY_TEST = "tests/gpu/test_overlap.py::test_a_training_step_never_waits_on_the_host_for_the_gpu"


def test_gloo_gpu_runs_need_one_gpu_and_report_nccl_only_tests(tmp_path):
    # Ranks share one GPU over Gloo: one GPU is needed for any world, and a test of what
    # only NCCL does is reported as skipped with its reason (not silently, not failed).
    env = without_gpus(MFSDP_REQUIRE_GPU="1", MFSDP_GPU_BACKEND="gloo", MFSDP_GPU_WORLD="4")
    proc, counts = run_pytest(tmp_path, env, GPU_TEST)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "this gpu test did not run (needs 1 CUDA GPUs for 4 ranks on gloo, found 0)" in proc.stdout
    # With GPUs hidden a test is skipped for lack of one before anything else; the
    # NCCL-only decision needs a GPU, so the conftest is told of one (its test override).
    env["MFSDP_TEST_GPU_COUNT"] = "1"
    proc, counts = run_pytest(tmp_path, env, NCCL_ONLY_TEST + "[fp32]")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(counts["skipped"]) == 1 and not counts["failed"] and not counts["errors"], counts
    assert "NCCL-only behaviour: runs in the NCCL suite (MFSDP_GPU_BACKEND=nccl)" in proc.stdout


def test_run_all_stops_before_building_when_gpus_are_missing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tests/gpu/run_all.sh"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=without_gpus(OUT=str(out), PYTHON=sys.executable, MFSDP_COMMIT="abc1234"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MFSDP_GPU_WORLD=2 but torch sees 0 CUDA GPUs" in proc.stderr
    assert not (out / "build.log").exists(), "run_all.sh built before checking the GPUs"
    summary = (out / "summary.md").read_text()
    for fragment in ("**FAIL**", "torch sees 0 CUDA GPUs", "GPU tests (parallel): no junit file", "`abc1234`"):
        assert fragment in summary, summary


def junit(cases):
    """A pytest-style junit file: cases are (name, outcome, seconds)."""
    body = "".join(
        f'<testcase classname="tests.gpu.test_x" name="{name}" time="{seconds}">'
        + {"passed": "", "failed": '<failure message="boom"/>', "error": '<error message="boom"/>',
           "skipped": '<skipped message="no GPU"/>'}[outcome] + "</testcase>"
        for name, outcome, seconds in cases)
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'


def test_summary_fails_a_gpu_run_with_a_skip_a_failure_or_no_tests(tmp_path):
    summarizer = load_summarizer()
    out = tmp_path / "out"
    out.mkdir()
    (out / "pytest_gpu.log").write_text("...\n===== 2 passed, 1 skipped in 12.5s =====\n")
    (out / "junit_gpu_exclusive.xml").write_text(junit([("test_overlap", "passed", 30.0)]))
    (out / "junit_gpu.xml").write_text(junit([("test_a", "passed", 1.5), ("test_b", "passed", 20.0),
                                              ("test_c", "skipped", 0.0)]))
    args = [str(out), "--commit", "abc1234", "--expect-gpu-tests", "--stage", "build=0"]
    assert summarizer.main(args) == 1
    summary = (out / "summary.md").read_text()
    for fragment in ("**FAIL**", "GPU tests (parallel): 1 skipped", "- `tests.gpu.test_x::test_c`",
                     "| GPU tests (parallel) | 3 | 2 | 0 | 0 | 1 | 22 |", "`===== 2 passed, 1 skipped in 12.5s =====`",
                     "- 20.0 s `tests.gpu.test_x::test_b`", "- commit: `abc1234`"):
        assert fragment in summary, summary

    (out / "junit_gpu.xml").write_text(junit([("test_a", "passed", 1.5), ("test_b", "passed", 20.0)]))
    assert summarizer.main(args) == 0
    assert "**PASS**" in (out / "summary.md").read_text()
    assert summarizer.main(args + ["--stage", "gpu_exclusive_tests=1"]) == 1
    (out / "junit_gpu.xml").write_text(junit([("test_a", "failed", 1.0), ("test_b", "error", 1.0)]))
    assert summarizer.main(args) == 1
    assert "GPU tests (parallel): 1 failed, 1 errors" in (out / "summary.md").read_text()
    (out / "junit_gpu.xml").write_text(junit([]))
    assert summarizer.main(args) == 1
    assert "GPU tests (parallel): no test ran" in (out / "summary.md").read_text()
    (out / "junit_gpu.xml").unlink()
    assert summarizer.main(args) == 1
    assert summarizer.main([str(out), "--commit", "abc1234"]) == 0  # GPU tests not asked for: CPU-only record


def test_source_digest_follows_sources_only(tmp_path):
    summarizer = load_summarizer()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "unit.cpp").write_text("int x;")
    (tmp_path / "megatron_fsdp_ext" / "__pycache__").mkdir(parents=True)
    first = summarizer.source_digest(tmp_path)
    (tmp_path / "megatron_fsdp_ext" / "__pycache__" / "a.py").write_text("generated")
    (tmp_path / "megatron_fsdp_ext" / "_build_info.py").write_text("generated at build time")
    (tmp_path / "megatron_fsdp_ext" / "_C.so").write_text("binary")
    assert summarizer.source_digest(tmp_path) == first
    (tmp_path / "csrc" / "unit.cpp").write_text("int y;")
    assert summarizer.source_digest(tmp_path) != first



class _Item:
    def __init__(self, nodeid, long):
        self.nodeid, self.long = nodeid, long

    def get_closest_marker(self, name):
        return object() if name == "long_gpu" and self.long else None


class _Config:
    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected += items


def test_gpu_suite_shards_partition_it(monkeypatch):
    # MFSDP_GPU_SHARD=k/n (tests/gpu/conftest.py): n device calls run the whole suite, each
    # test once, and the long tests are spread over the calls, not stacked in one.
    spec = importlib.util.spec_from_file_location("gpu_conftest", REPO / "tests/gpu/conftest.py")
    gpu_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_conftest)
    whole = [_Item(f"t{i}", long=i % 7 == 3) for i in range(40)]
    parts = []
    for k in (1, 2, 3):
        monkeypatch.setenv("MFSDP_GPU_SHARD", f"{k}/3")
        items, config = list(whole), _Config()
        gpu_conftest.pytest_collection_modifyitems(config, items)
        assert sorted(items + config.deselected, key=whole.index) == whole
        parts.append(items)
    assert sorted(sum(parts, []), key=whole.index) == whole
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    longs = [sum(item.long for item in part) for part in parts]
    assert max(longs) - min(longs) <= 1, longs
    for bad in ("3/2", "0/2", "half"):
        monkeypatch.setenv("MFSDP_GPU_SHARD", bad)
        with pytest.raises(ValueError, match=f"MFSDP_GPU_SHARD='{bad}': expected k/n"):
            gpu_conftest.pytest_collection_modifyitems(_Config(), list(whole))


TIMING_TEST = "tests/gpu/test_overlap.py::test_profiler_shows_overlap_in_a_normal_step"


def test_timing_tests_never_run_beside_other_xdist_workers(tmp_path):
    # The README's `-n auto` on a GPU machine: a gpu_exclusive (timing) test is skipped,
    # with its reason, on a worker that has others beside it; run_all.sh runs it alone.
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) runs the suite in parallel")
    env = without_gpus(MFSDP_TEST_GPU_COUNT="2")
    proc, counts = run_pytest(tmp_path, env, TIMING_TEST, xdist=("-n", "2", "-rs"))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(counts["skipped"]) == 1 and not counts["passed"] and not counts["failed"], counts
    assert "gpu_exclusive: a timing test, not run beside other xdist workers" in proc.stdout
