#!/usr/bin/env bash
# The "auto" bucket default on the GPU machine: the link it measures (NCCL, and Gloo with
# ranks sharing the GPUs), then bench_train's step and peak for ours with defaults
# ("mfsdp"), ours with one collective per unit ("mfsdp_unbucketed"), FSDP2, DDP and local,
# each in its own process, interleaved over ROUNDS. Usage (device machine, repo root):
#   OUT=... [CONFIGS=small_many,1b_comm_bound] [ROUNDS=2] bash benchmarks/run_auto_buckets.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
$PY -m pip install -q --no-deps .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
if [ -z "${SKIP_BUILD:-}" ]; then
  start=$(date +%s)
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"
fi
timeout 90 $PY -m torch.distributed.run --nproc_per_node="$NPROC" --master_port=29611 benchmarks/link_probe.py \
  --out "$OUT/link_nccl_world${NPROC}.json" > "$OUT/link_nccl.log" 2>&1 || tail -20 "$OUT/link_nccl.log"
timeout 120 $PY -m torch.distributed.run --nproc_per_node=$(( 2 * NPROC )) --master_port=29612 benchmarks/link_probe.py \
  --backend gloo --out "$OUT/link_gloo_world$(( 2 * NPROC ))_shared.json" > "$OUT/link_gloo.log" 2>&1 || tail -20 "$OUT/link_gloo.log"
$PY - "$OUT" <<'PYEOF'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("link_*.json")):
    d = json.loads(f.read_text())
    print(f.name, [(round(m["alpha_s"] * 1e6, 1), round(m["bytes_per_s"] / 1e9, 2), m["budget_bytes"] >> 20)
                   for m in d["measurements"]], "checks (MiB, measured ms, predicted ms):",
          [(c["bytes"] >> 20, round(c["measured_s"] * 1e3, 3), round(c["predicted_s"] * 1e3, 3)) for c in d["checks"]])
PYEOF
SKIP_BUILD=1 NPROC=$NPROC CONFIGS=${CONFIGS:-small_many,1b_comm_bound} ROUNDS=${ROUNDS:-2} STEPS=${STEPS:-15} \
  SYSTEMS=${SYSTEMS:-local,ddp,mfsdp,mfsdp_unbucketed,fsdp2} RUN_TIMEOUT=${RUN_TIMEOUT:-120} bash benchmarks/run_compare.sh
$PY - "$OUT/rows.json" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" not in r:
        print(r.get("round"), r["config"], r["system"], round(r["step_s"] * 1e3, 1), "ms peak", round(r["peak_mem_gib"], 3),
              "budgets", r.get("bucket_budgets"))
PYEOF
