#!/usr/bin/env bash
# One device call (planned for round 33): the fp16 GEMV with code pairs by PTX ("wna16p",
# never run on a GPU yet) and the transposed WNA16 product ("wna16t": W x^T, the dequantized
# tile as wgmma's register operand) against the shipped launches.
#   bash bench/run_r33.sh SHA
#  1. the Triton cache filled by 8 --compile-only workers;
#  2. the GPU tests of both (the GEMV and identity tests run "wna16p", bit for bit);
#  3. M = 1, 4 and 8 bits, groups of 128 and 32: the shipped GEMV against "wna16p" into
#     $OUT/wna16-pairs.json;
#  4. 4-bit, groups of 128, act-order too, M 2 .. 256: the shipped launch, the dequantized
#     path and the transposed tiles of 16 / 64 / 128 rows (64 and 128 columns, 4 and 8
#     warps) into $OUT/wna16-swap.json.
# carry [".whl"].
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
PAIRS=(--bits 4 8 --m 1 --launch wna16p,1,128,128,0,4,3 wna16p,1,64,128,0,4,3)
ARGS=(--bits 4 --act-order --m 2 4 8 16 32 64 128 256 --launch dequant
      wna16t,16,64,128,0,4,3 wna16t,16,128,128,0,4,3 wna16t,32,128,128,0,4,3
      wna16t,64,128,128,0,4,3 wna16t,64,128,128,0,8,3 wna16t,128,128,128,0,8,3
      wna16t,64,256,64,0,8,3)
step "compile (8 workers)"
for w in 0 1 2 3 4 5 6 7; do
  (timeout 100 python3 bench/time_wna16.py --compile-only "${PAIRS[@]}" --worker "$w/8" \
     > /dev/null 2>&1
   timeout 200 python3 bench/time_wna16.py --compile-only "${ARGS[@]}" --worker "$w/8" \
     > /dev/null 2>&1) &
done
wait
step "tests"
timeout 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_triton_wna16.py -k "transposed or (gemv and float16) or \
  (identity and float16)" 2>&1 | tail -3 || true
step "pairs"
timeout 60 python3 bench/time_wna16.py --git-commit "$SHA" "${PAIRS[@]}" \
  --out "$OUT/wna16-pairs.json" 2>&1 | tail -4 || true
timeout 60 python3 bench/time_wna16.py --git-commit "$SHA" "${PAIRS[@]}" --group 32 \
  --out "$OUT/wna16-pairs-g32.json" 2>&1 | tail -4 || true
step "timing"
timeout 240 python3 bench/time_wna16.py --git-commit "$SHA" "${ARGS[@]}" \
  --out "$OUT/wna16-swap.json" 2>&1 | tail -14 || true
step "done"
