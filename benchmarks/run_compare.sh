#!/usr/bin/env bash
# Every system of bench_train in its own process, interleaved and repeated
# (compare_systems.py), in one device call. Builds from source (SKIP_BUILD=1: already
# built), installs the carried wheels (megatron-fsdp, einops); $OUT gets summary.json,
# rows.json, compare.log, step_time.png and the logs of failed runs.
# NPROC: GPUs per run (default: all). At NPROC=1 every collective is skipped: what is left
# is each system's per-unit CPU and hook overhead (benchmarks/run_world1_overhead.sh).
# TIME_BUDGET: seconds for the runs (compare_systems.py --time-budget; default none): set it
# below the device call's limit, so the call ends with its summary instead of being cut.
# Usage (device machine, repo root):
#   OUT=... [NPROC=2] [SYSTEMS=...] [CONFIGS=...] [ROUNDS=3] [BENCH_ARGS="--experts 16 --ep 4"] \
#     bash benchmarks/run_compare.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
# COMPARE_DIR: where every run's output is kept (default: a new temporary folder).
WORK=${COMPARE_DIR:-$(mktemp -d)}
mkdir -p "$WORK"
mkdir -p "$OUT"
$PY -m pip install -q --no-deps .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
if [ -z "${SKIP_BUILD:-}" ]; then
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
$PY -c "import torch, megatron_fsdp; print('torch', torch.__version__, torch.cuda.get_device_name(), 'megatron_fsdp', megatron_fsdp.__version__)" | tee "$OUT/env.txt"
$PY benchmarks/compare_systems.py --nproc ${NPROC:-$(nvidia-smi -L | wc -l)} --rounds ${ROUNDS:-3} --configs ${CONFIGS:-small_many} \
  --systems ${SYSTEMS:-local,ddp,mfsdp,fsdp2,megatron_fsdp} --steps ${STEPS:-20} --warmup ${WARMUP:-5} \
  --timeout ${RUN_TIMEOUT:-300} --time-budget ${TIME_BUDGET:-0} --bench-args="${BENCH_ARGS:-}" --out "$WORK/compare" 2>&1 | tee "$OUT/compare.log" | tail -14
cp "$WORK/compare/summary.json" "$WORK/compare/rows.json" "$WORK/compare/step_time.png" "$OUT/" 2>/dev/null
# The full output of every run that failed, one file.
$PY - "$WORK/compare" > "$OUT/failed_runs.log" <<'PYEOF'
import json, sys, pathlib
root = pathlib.Path(sys.argv[1])
for row in json.loads((root / "rows.json").read_text()):
    if "error" in row and not row["error"].startswith("not run"):
        log = root / f"round{row['round']}" / row["config"] / row["system"] / "log.txt"
        print(f"===== round {row['round']} {row['config']} {row['system']}: {row['error']}")
        print(log.read_text()[-6000:] if log.exists() else "(no log)")
PYEOF
