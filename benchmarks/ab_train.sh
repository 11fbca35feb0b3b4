#!/usr/bin/env bash
# A/B of two builds of the library on bench_train: does a change move step time?
# Usage (GPU machine, repo root):
#   BASE=<dir holding an older tree> bash benchmarks/ab_train.sh
# Builds BASE and the current tree in place, the same way, then runs bench_train for
# SYSTEMS (default mfsdp) on CONFIGS with the base and the current tree alternately (which
# side goes first alternates by round), ROUNDS times (each run its own torchrun), and
# prints per config the median, min and max step time of each and the ratio of medians
# (benchmarks/ab_summary.py). Raw JSON: $OUT/ab/{base,new}_<round>/results.json.
# EXTRA_ARGS: more bench_train arguments for both sides (e.g. --meta-init for 13b).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
BASE=${BASE:?set BASE to the directory of the tree to compare against}
BASE=$(cd "$BASE" && pwd)  # absolute: each side runs from its own tree
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
AB=$OUT/ab
mkdir -p "$AB"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# Both sides built the same way (an editable pip install elsewhere would be a third build).
(cd "$BASE" && MAX_JOBS=8 $PY setup.py build_ext --inplace > "$AB/base_build.log" 2>&1) &
base_build=$!
MAX_JOBS=8 $PY setup.py build_ext --inplace > "$AB/new_build.log" 2>&1 || { tail -30 "$AB/new_build.log"; exit 1; }
wait $base_build || { tail -30 "$AB/base_build.log"; exit 1; }
status=0
for round in $(seq 1 "${ROUNDS:-3}"); do
  # The side that runs first alternates: a drift within a round falls on both alike.
  order="base new"; [ $((round % 2)) -eq 0 ] && order="new base"
  for side in $order; do
    tree=$PWD; [ $side = base ] && tree=$BASE
    echo "== $side round $round ($(date +%T))"
    (cd "$tree" && PYTHONPATH="$tree/src" timeout "${RUN_TIMEOUT:-150}" $PY -m torch.distributed.run \
      --nproc_per_node="$NPROC" benchmarks/bench_train.py --configs "${CONFIGS:-small_many,1b_comm_bound,1b}" \
      --systems "${SYSTEMS:-mfsdp}" --steps "${STEPS:-20}" --warmup "${WARMUP:-5}" --out "$AB/${side}_$round" ${EXTRA_ARGS:-} \
      > "$AB/${side}_$round.log" 2>&1) || { echo "$side round $round failed"; tail -20 "$AB/${side}_$round.log"; status=1; }
  done
done
$PY benchmarks/ab_summary.py "$AB" | tee "$AB/summary.md"
exit $status
