#!/usr/bin/env bash
# One GPU, no communication at all (world 1: every collective is skipped): how far each
# system's step is from the plain model's, i.e. its per-unit CPU and hook overhead alone.
# Builds from source, installs the carried wheels (megatron-fsdp, einops), runs
# compare_systems.py. Usage (device machine, repo root): OUT=... bash benchmarks/run_world1_overhead.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mfsdp_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -m pip install -q --no-deps .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
$PY -c "import torch, megatron_fsdp; print('torch', torch.__version__, torch.cuda.get_device_name(), 'megatron_fsdp', megatron_fsdp.__version__)" | tee "$OUT/env.txt"
$PY benchmarks/compare_systems.py --nproc 1 --rounds ${ROUNDS:-3} --configs ${CONFIGS:-small_many} \
  --systems ${SYSTEMS:-local,ddp,mfsdp,fsdp2,megatron_fsdp} --steps ${STEPS:-20} --warmup ${WARMUP:-5} \
  --timeout 300 --out "$OUT/compare" 2>&1 | tee "$OUT/compare.log" | tail -12
