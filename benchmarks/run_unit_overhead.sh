#!/usr/bin/env bash
# Per-unit CPU cost on one GPU (world 1, collectives skipped): builds from source and runs
# bench_unit_overhead.py with the operator table. Usage (device machine, repo root):
#   OUT=... bash benchmarks/run_unit_overhead.sh   (SKIP_BUILD=1: already installed)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
for units in ${UNITS:-64}; do
  torchrun --nproc_per_node=1 benchmarks/bench_unit_overhead.py --device cuda --units "$units" \
    --op-table ${OP_TABLE:-30} --out "$OUT/overhead_$units" 2>&1 | grep -v "USDT\|Warning" | tee "$OUT/overhead_$units.txt"
  cp "$OUT/overhead_$units/overhead.json" "$OUT/overhead_$units.json" && rm -r "$OUT/overhead_$units"
done
