#!/usr/bin/env bash
# One GPU, no communication at all (world 1: every collective is skipped): how far each
# system's step is from the plain model's, i.e. its per-unit CPU and hook overhead alone.
# Same variables as run_compare.sh. Usage (device machine, repo root):
#   OUT=... [SYSTEMS=...] [CONFIGS=...] [ROUNDS=3] bash benchmarks/run_world1_overhead.sh
NPROC=1 exec bash "$(dirname "$0")/run_compare.sh"
