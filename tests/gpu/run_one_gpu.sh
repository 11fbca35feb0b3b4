#!/usr/bin/env bash
# The multi-rank GPU suite on a one-GPU machine: every rank is a process on cuda:0 and the
# ranks talk over Gloo with CUDA tensors (NCCL refuses two ranks on one GPU). In one call:
# build from source (in place, so a mutation rebuilds only what changed), re-check the
# capability table (probe_backends.py), then the `gpu` tests for each world in WORLDS;
# NCCL-only tests are reported as skipped. Logs and junit files under $OUT.
# Usage (device machine, repo root): OUT=... bash tests/gpu/run_one_gpu.sh
#   WORLDS="2 4" (default "2"), GPU_JOBS (default 6: tests at a time, each with WORLD processes),
#   TESTS_<world> (test paths or ids for that world; default tests/gpu), PYTEST_ARGS,
#   SKIP_BUILD=1, SKIP_PROBE=1, SUITE_TIMEOUT (s per world).
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
export MFSDP_GPU_BACKEND=gloo MFSDP_REQUIRE_GPU=1
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
record_env
# In place, rebuilt every call: a mutation (tests/gpu/mutation_check.py) rebuilds only what changed.
[ -n "${SKIP_BUILD:-}" ] || FORCE_BUILD=1 build_in_place || exit 1
report_build
if [ -z "${SKIP_PROBE:-}" ]; then
  timeout 240 $PY tests/gpu/probe_backends.py "$OUT/probe.md" > "$OUT/probe.log" 2>&1 || status=1
  grep "|" "$OUT/probe.md" 2>/dev/null || tail -5 "$OUT/probe.log"
fi
for world in ${WORLDS:-2}; do
  tests_var="TESTS_$world"
  echo "== gpu tests, $world ranks on one GPU over Gloo: ${!tests_var:-tests/gpu}"
  MFSDP_GPU_WORLD=$world timeout "${SUITE_TIMEOUT:-420}" $PY -m pytest ${!tests_var:-tests/gpu} -q -p no:cacheprovider \
    -rs -n "${GPU_JOBS:-6}" --junitxml="$OUT/junit_gloo_w$world.xml" ${PYTEST_ARGS:-} \
    > "$OUT/pytest_gloo_w$world.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gloo_w$world.log" | tail -25
  [ "$rc" -eq 0 ] || status=1
done
echo "status=$status"
exit $status
