#!/usr/bin/env bash
# One device call on a 1-GPU machine: build from source, run tests/gpu/sanitizer_smoke.py
# plainly, then under compute-sanitizer memcheck (caching allocator off, so an access
# outside a live allocation is seen), and the C-surface fuzz on CPU. Logs under $OUT.
# Usage (GPU machine, repo root): bash tests/gpu/sanitizer_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/mfsdp_sanitizer}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY=python3
{
  date -u
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  nvidia-smi -L
} > "$OUT/env.txt" 2>&1
start=$(date +%s)
MAX_JOBS=16 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
PYTHONPATH=$PWD/src $PY -c "import megatron_fsdp_ext as m; print(m.build_info())" >> "$OUT/env.txt" 2>&1
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "compute-sanitizer: ${SAN:-not found}" | tee -a "$OUT/env.txt"
[ -n "$SAN" ] && "$SAN" --version >> "$OUT/env.txt" 2>&1

PYTHONPATH=$PWD/src timeout 180 $PY tests/gpu/sanitizer_smoke.py > "$OUT/smoke_plain.log" 2>&1
echo "smoke (plain): rc=$?" | tee -a "$OUT/summary.txt"
PYTHONPATH=$PWD/src timeout 120 $PY tests/unit/c_surface_fuzz.py 3000 0 > "$OUT/fuzz.log" 2>&1
echo "fuzz (CPU tensors, this build): rc=$? $(tail -1 "$OUT/fuzz.log")" | tee -a "$OUT/summary.txt"
if [ -n "$SAN" ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=$PWD/src timeout 420 "$SAN" --tool memcheck --error-exitcode 9 \
    --print-limit 50 $PY tests/gpu/sanitizer_smoke.py > "$OUT/memcheck.log" 2>&1
  echo "smoke under memcheck: rc=$? ($(grep -c 'Invalid\|Error' "$OUT/memcheck.log") lines mentioning errors)" \
    | tee -a "$OUT/summary.txt"
  grep "ERROR SUMMARY" "$OUT/memcheck.log" | tee -a "$OUT/summary.txt"
fi
# Which freed-storage API this torch has (see Unit::free_unsharded).
grep -n "throw_on_immutable_data_ptr_\|clear_data_ptr_access_error_msg_\|release_data_and_set_meta_custom\|void swap_data_ptr" \
  "$($PY -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include/c10/core/StorageImpl.h" \
  > "$OUT/storage_impl_api.txt" 2>&1
tail -3 "$OUT/smoke_plain.log"
