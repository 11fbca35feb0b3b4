#!/usr/bin/env bash
# All GPU benchmarks in one device call: build from source (unless already built),
# then bench_train (mfsdp vs FSDP2 vs DDP), bench_layerwise and bench_comm.
# Usage (GPU machine, repo root): bash benchmarks/run_gpu.sh   (results under $OUT/bench)
# NPROC (default: all GPUs), STEPS/WARMUP, CONFIGS, BENCHES (train,layerwise,comm),
# SYSTEMS (bench_train's --systems, e.g. mfsdp,fsdp2,mfsdp_compiled,fsdp2_compiled),
# COMM_ITERS and BENCH_TIMEOUT override the defaults. Every bench writes its raw JSON
# (results.json, layerwise.json, comm.json) under $OUT/bench/world$NPROC, with the run's
# date, machine, versions, command and commit: set MFSDP_COMMIT where the tree has no .git.
# Copy those files to benchmarks/data/ to keep the run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
BENCH=$OUT/bench/world$NPROC
if [[ -z ${MFSDP_COMMIT:-} ]] && git rev-parse HEAD >/dev/null 2>&1; then
  MFSDP_COMMIT=$(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
fi
export MFSDP_COMMIT=${MFSDP_COMMIT:-}
mkdir -p "$BENCH"
if ! $PY -c "import megatron_fsdp_ext" 2>/dev/null; then
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/bench_build.log" 2>&1 \
    || { tail -40 "$OUT/bench_build.log"; exit 1; }
fi
status=0
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" > "$BENCH/$name.log" 2>&1 || { echo "$name failed (rc $?)"; status=1; }
  tail -12 "$BENCH/$name.log"
}
TR="$PY -m torch.distributed.run --nproc_per_node=$NPROC"
BENCHES=${BENCHES:-train,layerwise,comm}
[[ $BENCHES == *train* ]] && run bench_train "${BENCH_TIMEOUT:-330}" $TR benchmarks/bench_train.py --configs "${CONFIGS:-1b,1b_comm_bound,small_many,8b_ish}" \
  --steps "${STEPS:-20}" --warmup "${WARMUP:-5}" --systems "${SYSTEMS:-mfsdp,fsdp2,ddp}" --out "$BENCH"
# Weak scaling against the recorded 2-GPU run (issue 6): tokens/s/GPU ratios per system.
if [[ $BENCHES == *train* && $NPROC != 2 && -f "$BENCH/results.json" ]]; then
  $PY benchmarks/scaling.py benchmarks/data/train_world2_h200_runE.json "$BENCH/results.json" \
    | tee "$BENCH/scaling.md" || status=1
fi
[[ $BENCHES == *layerwise* ]] && run bench_layerwise 120 $TR benchmarks/bench_layerwise.py --config 1b --steps 8 --warmup 3 --out "$BENCH"
[[ $BENCHES == *comm* ]] && run bench_comm 120 $TR benchmarks/bench_comm.py --sizes-mib 16,64,256 --iters "${COMM_ITERS:-50}" \
  --warmup 5 --out "$BENCH"
exit $status
