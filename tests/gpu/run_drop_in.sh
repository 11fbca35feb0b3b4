#!/usr/bin/env bash
# The drop-in work's GPU record (FSDPModule identity, torch's clip over ShardedGrad
# gradients, pipelining, Megatron's micro-batch controls) in one device call:
#   PART=tests  build, then the drop-in and pipelining GPU tests at MFSDP_GPU_WORLD (NCCL);
#   PART=ab     the interleaved step-time A/B against the tree in BASE (benchmarks/ab_train.sh),
#               BASE copied to /tmp/ab_base and built once per machine; its logs and JSON
#               packed into $OUT/ab_<configs>.tgz, the summary beside it;
#   PART=all    both.
# Usage (device machine, repo root): PART=tests MFSDP_GPU_WORLD=4 bash tests/gpu/run_drop_in.sh
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
record_env
build_in_place || exit 1
run_tests() {
  PYTHONPATH=src MFSDP_GPU_WORLD=${MFSDP_GPU_WORLD:-4} MFSDP_GPU_BACKEND=nccl MFSDP_REQUIRE_GPU=1 \
    timeout "${TEST_TIMEOUT:-420}" $PY -m pytest ${TESTS:-tests/gpu/test_drop_in_gpu.py tests/gpu/test_pipelining_gpu.py} \
    -v -p no:cacheprovider --junitxml="$OUT/junit_drop_in.xml" > "$OUT/pytest_drop_in.log" 2>&1
  local rc=$?
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_drop_in.log" | tail -25
  return $rc
}
run_ab() {
  [ -d /tmp/ab_base ] || cp -r "${BASE:-.ab_base}" /tmp/ab_base
  local tag=${CONFIGS:-small_many,1b}
  rm -rf /tmp/ab_out
  OUT=/tmp/ab_out BASE=/tmp/ab_base bash benchmarks/ab_train.sh
  local rc=$?
  tar czf "$OUT/ab_${tag//,/_}.tgz" -C /tmp/ab_out ab
  cp /tmp/ab_out/ab/summary.md "$OUT/ab_${tag//,/_}_summary.md" 2>/dev/null
  return $rc
}
case "${PART:-tests}" in
  tests) run_tests || status=1 ;;
  ab) run_ab || status=1 ;;
  all) run_tests || status=1; run_ab || status=1 ;;
esac
exit $status
