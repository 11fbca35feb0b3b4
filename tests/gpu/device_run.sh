#!/usr/bin/env bash
# One device call: tests/gpu/run_all.sh (build, all tests, example) then
# benchmarks/run_gpu.sh, with every log, trace and plot packed into $OUT/logs.tgz
# (the device tool returns at most 8 files) and the key summaries beside it:
# gpu_run_summary.md is the record to commit under tests/gpu/results/ (see its README).
# Usage (GPU machine, repo root): MFSDP_COMMIT=<hash> bash tests/gpu/device_run.sh   [SKIP_BENCH=1] [CONFIGS=...]
set -uo pipefail
FINAL_OUT=${OUT:-/tmp/mfsdp_final}
export OUT=/tmp/mfsdp_logs
mkdir -p "$OUT" "$FINAL_OUT"
status=0
bash tests/gpu/run_all.sh || status=1
if [ -z "${SKIP_BENCH:-}" ]; then bash benchmarks/run_gpu.sh || status=1; fi
tar czf "$FINAL_OUT/logs.tgz" --exclude='*.pt' -C "$OUT" .
# Eight files at most: the summary (with env.txt's contents) replaces env.txt; the junit
# files and the timing tests' log are in logs.tgz.
[ -f "$OUT/summary.md" ] && cp "$OUT/summary.md" "$FINAL_OUT/gpu_run_summary.md"
for f in pytest_gpu.log pytest_cpu.log example.log megatron_style.log; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$FINAL_OUT/"; done
find "$OUT/bench" -name results.md -exec cp {} "$FINAL_OUT/bench_results.md" \; 2>/dev/null
find "$OUT/bench" -name scaling.md -exec cp {} "$FINAL_OUT/scaling.md" \; 2>/dev/null
exit $status
