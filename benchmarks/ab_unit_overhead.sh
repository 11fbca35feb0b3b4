#!/usr/bin/env bash
# A/B of two builds of the library on bench_unit_overhead (per-unit CPU cost of the hooks,
# one GPU, world 1) and bench_checkpoint: does a change move them?
# Usage (GPU machine, repo root): BASE=<dir holding the older tree> bash benchmarks/ab_unit_overhead.sh
# Builds BASE and the current tree in place (in parallel), then runs ROUNDS rounds, each
# one process per side in alternating order, with this tree's benchmark scripts against
# each side's package (PYTHONPATH); OVERHEAD_ARGS go to bench_unit_overhead.py (e.g.
# "--param-dtype bf16"). Raw JSON: $OUT/ab_overhead/{base,new}_<round>.json and
# $OUT/ab_checkpoint/{base,new}_<round>.json; summary: benchmarks/ab_overhead_summary.py.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
BASE=${BASE:?set BASE to the directory of the tree to compare against}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
mkdir -p "$OUT/ab_overhead" "$OUT/ab_checkpoint"
(cd "$BASE" && MAX_JOBS=8 $PY setup.py build_ext --inplace > "$OUT/ab_overhead/base_build.log" 2>&1) &
base_build=$!
if [ -z "${SKIP_BUILD:-}" ]; then
  MAX_JOBS=8 $PY setup.py build_ext --inplace > "$OUT/ab_overhead/new_build.log" 2>&1 || { tail -30 "$OUT/ab_overhead/new_build.log"; exit 1; }
fi
wait $base_build || { tail -30 "$OUT/ab_overhead/base_build.log"; exit 1; }
status=0
for round in $(seq 1 "${ROUNDS:-4}"); do
  sides="base new"; [ $((round % 2)) = 0 ] && sides="new base"
  for side in $sides; do
    src=$PWD/src; [ $side = base ] && src=$BASE/src
    echo "== $side round $round ($(date +%T))"
    PYTHONPATH=$src timeout "${RUN_TIMEOUT:-120}" $PY -m torch.distributed.run --nproc_per_node=1 \
      benchmarks/bench_unit_overhead.py --device cuda --units "${UNITS:-64}" --variants per_unit \
      --steps "${STEPS:-30}" --warmup 5 --profile-steps 2 ${OVERHEAD_ARGS:-} --out "$OUT/ab_overhead/${side}_$round" \
      > "$OUT/ab_overhead/${side}_$round.log" 2>&1 || { echo "$side overhead round $round failed"; tail -5 "$OUT/ab_overhead/${side}_$round.log"; status=1; }
    mv "$OUT/ab_overhead/${side}_$round/overhead.json" "$OUT/ab_overhead/${side}_$round.json" 2>/dev/null
    rm -rf "$OUT/ab_overhead/${side}_$round"
    if [ -z "${SKIP_CHECKPOINT:-}" ]; then
      PYTHONPATH=$src timeout "${RUN_TIMEOUT:-120}" $PY -m torch.distributed.run --nproc_per_node=1 \
        benchmarks/bench_checkpoint.py --device cuda --repeats 3 --dir /tmp/ab_ckpt \
        --out "$OUT/ab_checkpoint/${side}_$round.json" > "$OUT/ab_checkpoint/${side}_$round.log" 2>&1 \
        || { echo "$side checkpoint round $round failed"; tail -5 "$OUT/ab_checkpoint/${side}_$round.log"; status=1; }
    fi
  done
done
$PY benchmarks/ab_overhead_summary.py "$OUT" | tee "$OUT/ab_summary.md"
exit $status
