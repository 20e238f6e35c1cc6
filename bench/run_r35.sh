#!/usr/bin/env bash
# One device call (round 35): the transposed tiles that gained 1.16x at 2-16 rows and 1.10x
# at 32 in round 33 (4-bit, groups of 128, fp16), over the other weights the default
# serves: 8 bits, groups of 32, float offsets (GGUF's Q4_1 / K-quants), bf16.
#   bash bench/run_r35.sh SHA      (into $OUT/wna16-t-*.json; carry [".whl"])
set -uo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
T=(--m 4 16 32 --launch wna16t,16,128,128,0,4,3 wna16t,32,128,128,0,4,3)
SETS=("g128:--bits 4 8 --group 128" "g32:--bits 4 8 --group 32"
      "off32:--bits 4 --group 32 --offset" "bf16:--bits 4 8 --group 128 --dtype bfloat16")
step "compile (8 workers)"
for w in 0 1 2 3 4 5 6 7; do
  (for set in "${SETS[@]}"; do
     # shellcheck disable=SC2086 # each set is split into its words on purpose
     timeout 100 python3 bench/time_wna16.py --compile-only ${set#*:} "${T[@]}" \
       --worker "$w/8" > /dev/null 2>&1 || true
   done) &
done
wait
for set in "${SETS[@]}"; do
  step "${set%%:*}"
  # shellcheck disable=SC2086
  timeout 60 python3 bench/time_wna16.py --git-commit "$SHA" ${set#*:} "${T[@]}" \
    --out "$OUT/wna16-t-${set%%:*}.json" 2>&1 | tail -5
done
step "done"
