# Sourced by the GPU scripts (tests/gpu/run_*.sh): the environment every device call needs,
# and the steps they share. Sets OUT (created), PY, status=0; defines:
#   record_env [python-expr-label ...]  GPUs, driver, torch/CUDA/NCCL (and any extra lines) into $OUT/env.txt
#   install_wheel MODULE GLOB           pip-install a carried wheel from .whl/ when MODULE does not import
#   build_in_place                      build the extension into src/ unless it already imports
#                                       (FORCE_BUILD=1 rebuilds); build log in $OUT/build.log
#   report_build                        build_info() into $OUT/env.txt
# NVLink multicast stays off: the lent machines do not support it (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
OUT=${OUT:-/tmp/mfsdp_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0

record_env() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    echo "cores $(nproc)"
    git log --oneline -1 2>/dev/null
    local line
    for line in "$@"; do echo "$line"; done
  } 2>&1 | tee -a "$OUT/env.txt"
}

install_wheel() {
  local module=$1 pattern=$2
  $PY -c "import $module" 2>/dev/null && return 0
  # shellcheck disable=SC2086  # the pattern is a glob
  $PY -m pip install -q --no-deps .whl/$pattern >> "$OUT/env.txt" 2>&1 \
    || { echo "could not install $module from .whl/$pattern" | tee -a "$OUT/env.txt"; return 1; }
}

build_in_place() {
  if [ -z "${FORCE_BUILD:-}" ] && PYTHONPATH=$PWD/src $PY -c "import megatron_fsdp_ext._C" 2>/dev/null; then
    return 0
  fi
  local start
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; return 1; }
  echo "built in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt"
}

report_build() {
  PYTHONPATH=$PWD/src $PY -c "import megatron_fsdp_ext as m; print(m.build_info())" | tee -a "$OUT/env.txt"
}
