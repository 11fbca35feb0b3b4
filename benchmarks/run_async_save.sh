#!/usr/bin/env bash
# Checkpoint save/load time on the GPU machine: ours (sync save, async save, load) against
# FSDP2 + torch.distributed.checkpoint (dcp.save, dcp.async_save, dcp.load), the 1.3B
# Llama of bench_train ("1b"), at world 1 and 4, each system in its own torchrun.
# Usage (repo root, package built by the caller): bash benchmarks/run_async_save.sh
# JSON per run under $OUT/async_save/world<W>_<system>.json (with the machine, torch, NCCL
# and commit: set MFSDP_COMMIT where the tree has no .git); logs beside them.
# REPEATS (default 3), MODEL (default 1b), WORLDS (default "1 4"), SYSTEMS (default
# "mfsdp fsdp2"), CKPT_DIR (where checkpoints are written and removed; default /tmp) and
# RUN_TIMEOUT (seconds per run, default 150) and MODES (default sync,async,load) override the
# defaults. A 1b checkpoint with
# AdamW state is ~16 GB: each is removed as soon as it is measured.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
DEST=$OUT/async_save
mkdir -p "$DEST"
if [[ -z ${MFSDP_COMMIT:-} ]] && git rev-parse HEAD >/dev/null 2>&1; then
  MFSDP_COMMIT=$(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)
fi
export MFSDP_COMMIT=${MFSDP_COMMIT:-}
status=0
for world in ${WORLDS:-1 4}; do
  for system in ${SYSTEMS:-mfsdp fsdp2}; do
    name=world${world}_${system}
    echo "== $name ($(date +%T))"
    timeout "${RUN_TIMEOUT:-150}" $PY -m torch.distributed.run --nproc_per_node="$world" --master_port=29591 \
      benchmarks/bench_async_save.py --system "$system" --model "${MODEL:-1b}" --repeats "${REPEATS:-3}" \
      --modes "${MODES:-sync,async,load}" \
      --dir "${CKPT_DIR:-/tmp}" --out "$DEST/$name.json" > "$DEST/$name.log" 2>&1 \
      || { echo "$name failed (rc $?)"; status=1; }
    tail -3 "$DEST/$name.log"
  done
done
exit $status
