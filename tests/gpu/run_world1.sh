#!/usr/bin/env bash
# A 1-GPU machine's share of the GPU checks, in one call: build from source, the `gpu`
# tests that are meaningful at world 1 (NCCL world 1: CUDA random number generator,
# allocator peaks, autograd threads, the bucket paths' streams and events, CUDA-graph
# capture) and the CUDA smoke test. At world 1 every collective is a copy. The 2-GPU suite
# (tests/gpu/run_all.sh) remains the record for anything distributed.
# Usage (device machine, repo root): OUT=... bash tests/gpu/run_world1.sh
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
record_env
install_wheel safetensors "safetensors-*.whl"
# Installed (editable), not only built in place: the tests' subprocesses import the package.
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-16} $PY -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt"
report_build
MFSDP_GPU_WORLD=1 MFSDP_REQUIRE_GPU=1 $PY -m pytest -q -p no:cacheprovider -rA -s \
  tests/gpu/test_deferred_init_gpu.py \
  tests/distributed/test_profiler_labels.py::test_unit_trace_sees_backward_on_autograd_threads_under_nccl \
  "tests/gpu/test_nccl.py::test_nccl_parity[gather_buckets]" \
  "tests/gpu/test_nccl.py::test_nccl_parity[gather_buckets_bf16]" \
  "tests/gpu/test_nccl.py::test_nccl_parity[reduce_buckets]" \
  "tests/gpu/test_nccl.py::test_nccl_parity[buckets_bf16]" \
  "tests/gpu/test_nccl.py::test_nccl_parity_under_stream_chaos[buckets_bf16]" \
  tests/gpu/test_overlap.py::test_whole_training_step_in_a_cuda_graph_matches_plain_pytorch \
  tests/gpu/test_overlap.py::test_a_gather_bucket_records_and_waits_once \
  tests/gpu/test_overlap.py::test_a_training_step_never_waits_on_the_host_for_the_gpu \
  --junitxml="$OUT/junit_world1.xml" 2>&1 | tee "$OUT/pytest_world1.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
PYTHONPATH=$PWD/src timeout 300 $PY tests/gpu/sanitizer_smoke.py > "$OUT/smoke.log" 2>&1 || status=1
tail -3 "$OUT/smoke.log"
echo "status=$status"
exit $status
