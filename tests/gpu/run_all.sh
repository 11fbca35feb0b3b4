#!/usr/bin/env bash
# Everything the GPU machine must show, in one call: build from source, the whole
# test suite (CPU/Gloo + NCCL `gpu` tests), and the example on 2 GPUs.
# Usage (device machine, repo root): MFSDP_COMMIT=<hash> bash tests/gpu/run_all.sh   (logs under $OUT)
# MFSDP_COMMIT: the commit the copied tree comes from (the device copy has no .git);
# else `git rev-parse HEAD` (+ "-dirty"), or the file .mfsdp_commit, else "unknown".
# GPU_JOBS (default 2): NCCL test files run this many at a time, each using both GPUs;
# tests marked gpu_exclusive (timing) run afterwards, one at a time.
# SKIP_CPU_TESTS / SKIP_GPU_TESTS / SKIP_EXAMPLE skip a part; EXAMPLE_STEPS shortens train_gpt;
# GPU_TESTS_TIMEOUT (default 900) / GPU_EXCLUSIVE_TIMEOUT (default: the same) bound the two GPU
# pytest runs; MFSDP_DEADLINE (epoch seconds) ends both by then, GPU_EXCLUSIVE_RESERVE (default
# 60) seconds of it kept for the timing tests. A stage cut by its limit gets SIGINT first, so
# pytest still prints its failures' tracebacks and writes its junit file.
# MFSDP_FAILURE_LOG=<file>: every GPU test's outcome, and each failure's traceback, as it
# happens (tests/gpu/conftest.py), so a run cut short still shows what failed and why.
# MFSDP_GPU_TESTS_FIRST: comma-separated substrings of test ids run first (tests/gpu/conftest.py).
# MFSDP_GPU_SHARD=k/n: this call runs the k-th of n parts of the GPU tests (tests/gpu/conftest.py);
# at world 4 the suite needs about 2,000 test-seconds, so two calls (1/2, 2/2) of GPU_JOBS=6 each
# fit the 8-minute device call with the build.
# MFSDP_GPU_WORLD=4 runs the NCCL tests and examples on 4 GPUs (default 2).
# A run cannot pass empty: fewer GPUs than MFSDP_GPU_WORLD fail it at once, a skipped `gpu`
# test fails (MFSDP_REQUIRE_GPU=1, tests/conftest.py), and $OUT/summary.md (from
# tests/gpu/summarize_run.py, with the junit files) records commit, date, versions, counts.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
mkdir -p "$OUT"
rm -f "$OUT"/junit_*.xml "$OUT/gpu_check.txt" "$OUT/summary.md"
PY=${PYTHON:-python3}
WORLD=${MFSDP_GPU_WORLD:-2}
if [[ -z ${MFSDP_COMMIT:-} ]] && git rev-parse HEAD >/dev/null 2>&1; then
  MFSDP_COMMIT=$(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
fi
COMMIT=${MFSDP_COMMIT:-$(cat .mfsdp_commit 2>/dev/null || echo unknown)}
export MFSDP_COMMIT=$COMMIT  # benchmarks/run_gpu.sh records it too
status=0
stages=()
expect_gpu=()
[ -z "${SKIP_GPU_TESTS:-}" ] && expect_gpu=(--expect-gpu-tests)

finish() {
  # ${a[@]+...}: empty arrays are "unbound" under set -u in bash < 4.4.
  $PY tests/gpu/summarize_run.py "$OUT" --commit "$COMMIT" ${expect_gpu[@]+"${expect_gpu[@]}"} \
    ${stages[@]+"${stages[@]}"} > /dev/null \
    || status=1
  echo "== summary: $OUT/summary.md"
  head -12 "$OUT/summary.md"
  exit $status
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"

# Before the build (minutes): the GPU parts need MFSDP_GPU_WORLD GPUs, or the run fails.
if [ -z "${SKIP_GPU_TESTS:-}" ] || [ -z "${SKIP_EXAMPLE:-}" ]; then
  found=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  if [ "$found" -lt "$WORLD" ]; then
    echo "FAIL: MFSDP_GPU_WORLD=$WORLD but torch sees $found CUDA GPUs: the GPU tests and examples cannot run" \
      | tee "$OUT/gpu_check.txt" >&2
    status=1
    finish
  fi
fi

echo "== build"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  $PY -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 \
  || { tail -60 "$OUT/build.log"; status=1; stages+=(--stage build=1); finish; }
stages+=(--stage build=0)
echo "built in $(( $(date +%s) - start ))s"
$PY -c "import megatron_fsdp_ext as m; print(m.build_info())" | tee -a "$OUT/env.txt"

echo "== diagnostics"
{ ls /opt/torch/.venv/include 2>/dev/null | head; ldd src/megatron_fsdp_ext/_C*.so | grep -E "stdc|c10"; } > "$OUT/diag.txt" 2>&1
$PY -c "import torch, megatron_fsdp_ext._C as C; print(C.FlatLayout.even([3, 5], 2, 4))" >> "$OUT/diag.txt" 2>&1

# CPU/Gloo tests in parallel (they use no GPU; `gpu` tests deselected); the NCCL tests GPU_JOBS at a time, each
# using MFSDP_GPU_WORLD GPUs; then the timing tests, alone.
if [ -z "${SKIP_CPU_TESTS:-}" ]; then
  echo "== CPU/Gloo tests (xdist)"
  $PY -m pytest tests/unit tests/distributed -q -p no:cacheprovider -n 16 -m "not gpu" --junitxml="$OUT/junit_cpu.xml" \
    ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_cpu.log" | tail -15
  rc=${PIPESTATUS[0]}; stages+=(--stage cpu_tests=$rc); [ "$rc" -eq 0 ] || status=1
fi
# Seconds a stage may run: its own limit, shortened to end `reserve` seconds before
# MFSDP_DEADLINE when that is set (at least 30).
stage_limit() {
  local limit=$1 reserve=$2
  if [[ -n ${MFSDP_DEADLINE:-} ]]; then
    local left=$(( MFSDP_DEADLINE - $(date +%s) - reserve ))
    (( left < 30 )) && left=30
    (( left < limit )) && limit=$left
  fi
  echo "$limit"
}
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
  export MFSDP_TRACE_DIR=$OUT/traces; mkdir -p "$MFSDP_TRACE_DIR"
  export MFSDP_REQUIRE_GPU=1  # a skipped gpu test fails
  # The `gpu` tests that live beside their Gloo twins in tests/distributed belong to this stage.
  mapfile -t distributed_gpu < <($PY -m pytest tests/distributed -q --collect-only -p no:cacheprovider \
    -m "gpu and not gpu_exclusive" 2>/dev/null | grep "::")
  echo "gpu tests in tests/distributed: ${#distributed_gpu[@]}; shard ${MFSDP_GPU_SHARD:-all}" | tee -a "$OUT/env.txt"
  limit=$(stage_limit "${GPU_TESTS_TIMEOUT:-900}" "${GPU_EXCLUSIVE_RESERVE:-60}")
  echo "== GPU tests (limit ${limit}s)"
  start=$(date +%s)
  timeout -s INT -k 30 "$limit" \
    $PY -m pytest tests/gpu tests/unit/test_pack.py ${distributed_gpu[@]+"${distributed_gpu[@]}"} \
      -v -p no:cacheprovider -rs -n "${GPU_JOBS:-2}" \
      -m "not gpu_exclusive" --junitxml="$OUT/junit_gpu.xml" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
  rc=${PIPESTATUS[0]}; stages+=(--stage gpu_tests=$rc); [ "$rc" -eq 0 ] || status=1
  echo "GPU tests: rc $rc, $(( $(date +%s) - start ))s wall" | tee -a "$OUT/env.txt"
  limit=$(stage_limit "${GPU_EXCLUSIVE_TIMEOUT:-${GPU_TESTS_TIMEOUT:-900}}" 0)
  echo "== GPU timing tests (alone on the GPUs, limit ${limit}s)"
  start=$(date +%s)
  timeout -s INT -k 30 "$limit" \
    $PY -m pytest tests/gpu -v -p no:cacheprovider -rs -p no:xdist -m gpu_exclusive \
      --junitxml="$OUT/junit_gpu_exclusive.xml" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_gpu_exclusive.log" | tail -8
  rc=${PIPESTATUS[0]}; stages+=(--stage gpu_exclusive_tests=$rc); [ "$rc" -eq 0 ] || status=1
  echo "GPU timing tests: rc $rc, $(( $(date +%s) - start ))s wall" | tee -a "$OUT/env.txt"
  unset MFSDP_REQUIRE_GPU
fi

if [ -z "${SKIP_EXAMPLE:-}" ]; then
  NPROC=${MFSDP_GPU_WORLD:-2}
  echo "== examples on $NPROC GPUs"
  torchrun --nproc_per_node="$NPROC" examples/train_gpt.py --steps "${EXAMPLE_STEPS:-200}" --out-dir "$OUT/train_gpt" \
    > "$OUT/example.log" 2>&1
  rc=$?; stages+=(--stage train_gpt=$rc); [ "$rc" -eq 0 ] || status=1
  tail -3 "$OUT/example.log"
  # Megatron-style script: save under ZeRO-3 on all GPUs, resume under no_shard on 1.
  { torchrun --nproc_per_node="$NPROC" examples/megatron_style.py --train-iters 20 --save "$OUT/megatron_ckpt" &&
    torchrun --nproc_per_node=1 examples/megatron_style.py --train-iters 40 --load "$OUT/megatron_ckpt" \
      --data-parallel-sharding-strategy no_shard; } > "$OUT/megatron_style.log" 2>&1
  rc=$?; stages+=(--stage megatron_style=$rc); [ "$rc" -eq 0 ] || status=1
  rm -rf "$OUT/megatron_ckpt"
  tail -3 "$OUT/megatron_style.log"
fi
finish
