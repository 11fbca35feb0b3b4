#!/usr/bin/env bash
# FP8 on a one-GPU machine, in one call per phase (device machine, repo root):
#   OUT=... PHASE=tests bash tests/gpu/run_fp8.sh   build; tests/gpu/test_fp8_gpu.py at world 2
#                                                   (Gloo, one GPU) and world 1 (NCCL); the
#                                                   200-step numerics (benchmarks/fp8_numerics.py)
#   OUT=... PHASE=bench bash tests/gpu/run_fp8.sh   build if needed; benchmarks/simulate.py --fp8
#                                                   for ours, FSDP2 + torchao and local at world 1
#                                                   and fake world 8, all rows in $OUT/sim_fp8.json
#   PHASE=all: both
# Carries torchao as a wheel in .whl/ (torch 2.11 there: torchao 0.18.0 imports; its MXFP8 training gate is bypassed by the tests).
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
install_wheel torchao "torchao-${TORCHAO:-0.18.0}-*.whl"
record_env "$($PY -c 'import torchao; print("torchao", torchao.__version__)' 2>&1)"
build_in_place || exit 1
report_build
phase=${PHASE:-tests}
case "$phase" in
  tests|all)
    MFSDP_GPU_WORLD=2 MFSDP_GPU_BACKEND=gloo MFSDP_REQUIRE_GPU=1 timeout 400 $PY -m pytest -q -p no:cacheprovider \
      -rs -n 4 tests/gpu/test_fp8_gpu.py > "$OUT/pytest_fp8_gloo_w2.log" 2>&1 \
      || status=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_fp8_gloo_w2.log" | tail -15
    MFSDP_GPU_WORLD=1 MFSDP_GPU_BACKEND=nccl MFSDP_REQUIRE_GPU=1 timeout 300 $PY -m pytest -q -p no:cacheprovider \
      -rs tests/gpu/test_fp8_gpu.py > "$OUT/pytest_fp8_nccl_w1.log" 2>&1 \
      || status=1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_fp8_nccl_w1.log" | tail -15
    timeout 300 $PY benchmarks/fp8_numerics.py --nproc 1 --steps ${NUMERICS_STEPS:-200} --out "$OUT/fp8_numerics" \
      --work /tmp/fp8_numerics_runs \
      > "$OUT/fp8_numerics.log" 2>&1 || status=1
    rm -f "$OUT"/fp8_numerics/metrics_*.json  # the curves are in fp8_numerics.json
    tail -40 "$OUT/fp8_numerics.log"
    ;;
esac
case "$phase" in
  bench|all)
    # Rounds interleave the modes, so a drift of the machine shows as spread, not as a ratio.
    for round in $(seq ${ROUNDS:-2}); do
      for mode in ${FP8_MODES:-none tensorwise tensorwise_gather}; do
        echo "round $round" >> "$OUT/sim.log"
        timeout ${SIM_TIMEOUT:-300} $PY benchmarks/simulate.py --points "${POINTS:-1.3b@1,8}" \
          --systems ${SYSTEMS:-mfsdp,fsdp2,local} --fp8 $mode --steps ${STEPS:-10} --warmup 3 ${SIM_ARGS:-} \
          --out "/tmp/sim_fp8_${mode}_r$round" 2>&1 | grep -v "Failed to load\|KernelPreference" \
          | tee -a "$OUT/sim.log" || status=1
      done
    done
    # One file for all rows (the machine returns few files).
    $PY - "$OUT/sim_fp8.json" /tmp/sim_fp8_*/simulate.json <<'PYEOF'
import json, sys
runs = [json.load(open(f)) for f in sys.argv[2:]]
json.dump({"meta": [r["meta"] for r in runs],
           "rows": [dict(row, round=int(f.rsplit("_r", 1)[1].split("/")[0])) for f, r in zip(sys.argv[2:], runs)
                    for row in r["rows"]]},
          open(sys.argv[1], "w"), indent=1)
PYEOF
    ;;
esac
echo "status=$status"
exit $status
