#!/usr/bin/env bash
# CPU offload on a one-GPU machine, one call per phase (device machine, repo root):
#   OUT=... PHASE=tests bash tests/gpu/run_offload.sh   build; tests/gpu/test_offload_gpu.py at world 1
#                                                       (NCCL) and world 2 (Gloo, one GPU); the CPU
#                                                       optimizer bench (benchmarks/offload.py --optim-bench)
#   OUT=... PHASE=bench CONFIGS=1.3b SYSTEMS=... bash tests/gpu/run_offload.sh
#                                                       benchmarks/offload.py, rows in $OUT/offload.json
# A build from an earlier call may be carried in .gpu_build/ (copied into place, skipping the build).
# DeepSpeed and its dependencies are carried as wheels in .whl/ds/ (installed only where missing).
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
record_env "$(free -g | head -2)"
if [ -f .gpu_build/_C.so ]; then
  cp .gpu_build/_C.so src/megatron_fsdp_ext/_C.cpython-312-x86_64-linux-gnu.so
  cp .gpu_build/_build_info.py src/megatron_fsdp_ext/_build_info.py
fi
if ! $PY -c "import megatron_fsdp_ext._C" 2>/dev/null; then
  build_in_place || exit 1
  mkdir -p "$OUT/build"
  cp src/megatron_fsdp_ext/_C.cpython-312-x86_64-linux-gnu.so "$OUT/build/_C.so"
  cp src/megatron_fsdp_ext/_build_info.py "$OUT/build/_build_info.py"
fi
report_build
phase=${PHASE:-tests}
case "$phase" in
  tests)
    # The overlap test reads a profile's timing: alone, not beside three other test processes
    # contending for the host's cores (it failed once that way on an H100).
    MFSDP_GPU_WORLD=1 MFSDP_GPU_BACKEND=nccl MFSDP_REQUIRE_GPU=1 timeout 300 $PY -m pytest -q -p no:cacheprovider \
      -rs -n 4 -k "not overlap_and_never_block" tests/gpu/test_offload_gpu.py > "$OUT/pytest_offload_nccl_w1.log" 2>&1 \
      || status=1
    MFSDP_GPU_WORLD=1 MFSDP_GPU_BACKEND=nccl MFSDP_REQUIRE_GPU=1 timeout 120 $PY -m pytest -q -p no:cacheprovider \
      -rs -k "overlap_and_never_block" tests/gpu/test_offload_gpu.py >> "$OUT/pytest_offload_nccl_w1.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_offload_nccl_w1.log" | tail -15
    MFSDP_GPU_WORLD=2 MFSDP_GPU_BACKEND=gloo MFSDP_REQUIRE_GPU=1 timeout 300 $PY -m pytest -q -p no:cacheprovider \
      -rs -n 4 tests/gpu/test_offload_gpu.py > "$OUT/pytest_offload_gloo_w2.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_offload_gloo_w2.log" | tail -15
    timeout 200 $PY benchmarks/offload.py --optim-bench ${OPTIM_CONFIG:-1.3b} --repeats 5 --out "$OUT" \
      > "$OUT/optim_bench.log" 2>&1 || status=1
    cat "$OUT/optim_bench.log"
    ;;
  bench)
    $PY -c "import deepspeed" 2>/dev/null || $PY -m pip install -q --no-index --find-links .whl/ds deepspeed \
      >> "$OUT/env.txt" 2>&1 || echo "deepspeed did not install" | tee -a "$OUT/env.txt"
    timeout ${BENCH_TIMEOUT:-540} $PY benchmarks/offload.py --configs "${CONFIGS:-1.3b}" \
      --systems "${SYSTEMS:-mfsdp,fsdp2,fsdp2_fused,deepspeed}" --steps ${STEPS:-4} --warmup ${WARMUP:-2} \
      --rounds ${ROUNDS:-1} --timeout ${SYSTEM_TIMEOUT:-400} --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
    ;;
esac
echo "status=$status"
exit $status
