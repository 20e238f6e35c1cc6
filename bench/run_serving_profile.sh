#!/usr/bin/env bash
# One device call (~1 min a mode): bench_engine.py --serving-only with --profile-serving
# (where the steady state's GPU time goes, by kernel category) for each mode named.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_serving_profile.sh OUT_DIR GIT_SHA MODE... (bf16 fp8w fp8kv both)
set -uo pipefail
out=$1 sha=$2; shift 2
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
for mode in "$@"; do
  echo "=== engine $mode ($(( $(date +%s) - t0 )) s)"
  engine_mode "$out" "$mode" "$sha"
done
echo "=== done ($(( $(date +%s) - t0 )) s)"
