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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MFSDP_GPU_BACKEND=gloo MFSDP_REQUIRE_GPU=1
OUT=${OUT:-/tmp/mfsdp_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee -a "$OUT/env.txt"
if [ -z "${SKIP_BUILD:-}" ]; then
  start=$(date +%s)
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt"
fi
$PY -c "import megatron_fsdp_ext as m; print(m.build_info())" | tee -a "$OUT/env.txt"
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
