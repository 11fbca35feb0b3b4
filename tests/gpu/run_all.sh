#!/usr/bin/env bash
# Everything the GPU machine must show, in one call: build from source, the whole
# test suite (CPU/Gloo + NCCL `gpu` tests), and the example on 2 GPUs.
# Usage (device machine, repo root): bash tests/gpu/run_all.sh   (logs under $OUT)
# GPU_JOBS (default 2): NCCL test files run this many at a time, each using both GPUs.
# SKIP_CPU_TESTS / SKIP_GPU_TESTS / SKIP_EXAMPLE skip a part; EXAMPLE_STEPS shortens train_gpt;
# MFSDP_GPU_WORLD=4 runs the NCCL tests and examples on 4 GPUs (default 2).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.txt"

echo "== build"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  $PY -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 \
  || { tail -60 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start ))s"
$PY -c "import megatron_fsdp_ext as m; print(m.build_info())" | tee -a "$OUT/env.txt"

echo "== diagnostics"
{ ls /opt/torch/.venv/include 2>/dev/null | head; ldd megatron_fsdp_ext/_C*.so | grep -E "stdc|c10"; } > "$OUT/diag.txt" 2>&1
$PY -c "import torch, megatron_fsdp_ext._C as C; print(C.FlatLayout.even([3, 5], 2, 4))" >> "$OUT/diag.txt" 2>&1

# CPU/Gloo tests in parallel (they use no GPU); the NCCL tests one at a time, each
# owning both GPUs.
if [ -z "${SKIP_CPU_TESTS:-}" ]; then
  echo "== CPU/Gloo tests (xdist)"
  $PY -m pytest tests/unit tests/distributed -q -p no:cacheprovider -n 16 ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_cpu.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
  echo "== GPU tests"
  export MFSDP_TRACE_DIR=$OUT/traces; mkdir -p "$MFSDP_TRACE_DIR"
  timeout "${GPU_TESTS_TIMEOUT:-900}" \
    $PY -m pytest tests/gpu tests/unit/test_pack.py -v -p no:cacheprovider -rs -n "${GPU_JOBS:-2}" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -z "${SKIP_EXAMPLE:-}" ]; then
  NPROC=${MFSDP_GPU_WORLD:-2}
  echo "== examples on $NPROC GPUs"
  torchrun --nproc_per_node="$NPROC" examples/train_gpt.py --steps "${EXAMPLE_STEPS:-200}" --out-dir "$OUT/train_gpt" \
    > "$OUT/example.log" 2>&1 || status=1
  tail -3 "$OUT/example.log"
  # Megatron-style script: save under ZeRO-3 on all GPUs, resume under no_shard on 1.
  { torchrun --nproc_per_node="$NPROC" examples/megatron_style.py --train-iters 20 --save "$OUT/megatron_ckpt" &&
    torchrun --nproc_per_node=1 examples/megatron_style.py --train-iters 40 --load "$OUT/megatron_ckpt" \
      --data-parallel-sharding-strategy no_shard; } > "$OUT/megatron_style.log" 2>&1 || status=1
  rm -rf "$OUT/megatron_ckpt"
  tail -3 "$OUT/megatron_style.log"
fi
exit $status
