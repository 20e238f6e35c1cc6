#!/usr/bin/env bash
# One device call (round 31, 2026-12-05): the WNA16 kernel's fused path rewritten (one
# tl.dot of BLOCK_K columns a step, contiguous activations; a one-row GEMV at M = 1),
# timed against fp16 cuBLAS per llama3-8b layer shape.
#   bash bench/run_r31.sh SHA sweep   (bef20d6: results/h100-2026-12-05-wna16-r31b*.json)
#  1. the Triton cache filled by 8 --compile-only workers (the sweep's and the defaults'
#     launches), so the timed steps compile nothing;
#  2. the WNA16 GPU tests (fp16 identity, the GEMV, CUDA graphs), stopping at a failure;
#  3. the launch sweep (4-bit, M 1 / 16 / 64, each axis around the default) into
#     $OUT/wna16-sweep.json;
#  4. the shipped launches (4-bit, act-order too) at M 1 .. 2,048 with the dequantized
#     path beside them into $OUT/wna16.json.
#   bash bench/run_r31.sh SHA tiles   the same steps with the sweep at M = 1 only and the
#     tensor-core tiles of 64 and 128 rows timed beside the shipped launches at every M
#     (where the dequantized path should take over: DEQUANT_MIN_M).
#   bash bench/run_r31.sh SHA chunks  (planned, about 4 minutes) the dequantized path whole
#     and in chunks of 512 .. 4,096 output columns (a scratch that stays in L2) at M 128 ..
#     2,048 into $OUT/wna16-chunks.json, then the float32 tests that failed in round 31's
#     fifth call and the chunk test.
# carry [".whl"].
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?sweep, tiles or chunks}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [ "$PART" = chunks ]; then
  timeout 150 python3 bench/time_wna16.py --git-commit "$SHA" --bits 4 --m 128 256 512 2048 \
    --launch dequant dequant,0,512,0,1,0 dequant,0,1024,0,1,0 dequant,0,2048,0,1,0 \
    dequant,0,4096,0,1,0 --out "$OUT/wna16-chunks.json" 2>&1 | tail -6 || true
  timeout 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_wna16.py \
    -k "equals_the_dequantized_product and 33 and float32 or float32_keeps or column_chunks" \
    2>&1 | tail -3 || true
  step "done"
  exit 0
fi
if [ "$PART" = sweep ]; then
  SWEEP=(--sweep --bits 4 --m 1 16 64 --launch dequant)
  DEFAULTS=(--bits 4 --act-order --m 1 2 4 8 16 32 64 128 256 512 2048 --launch dequant)
else
  SWEEP=(--sweep --bits 4 --m 1)
  DEFAULTS=(--bits 4 --act-order --m 1 2 4 8 16 32 64 128 256 512 2048 --launch dequant
            wna16,64,128,128,0,4,3 wna16,64,128,128,0,8,3 wna16,128,128,128,0,8,3
            wna16,128,256,64,0,8,3)
fi
step "compile (8 workers)"
for w in 0 1 2 3 4 5 6 7; do
  (timeout 200 python3 bench/time_wna16.py --compile-only "${SWEEP[@]}" --worker "$w/8" \
     > /dev/null 2>&1
   timeout 100 python3 bench/time_wna16.py --compile-only "${DEFAULTS[@]}" --worker "$w/8" \
     > /dev/null 2>&1) &
done
wait
step "wna16 tests (fp16 identity, GEMV, graphs)"
timeout 90 python3 -m pytest -q -x -o addopts="" -p no:cacheprovider \
  tests/model/test_triton_wna16.py tests/model/test_int_checkpoint.py \
  -k "(identity and float16) or gemv or cuda_graphs or launches" 2>&1 | tail -8 || true
step "sweep (4-bit)"
timeout 150 python3 bench/time_wna16.py --git-commit "$SHA" "${SWEEP[@]}" \
  --out "$OUT/wna16-sweep.json" 2>&1 | tail -24 || true
step "shipped launches (4-bit, act-order)"
timeout 200 python3 bench/time_wna16.py --git-commit "$SHA" "${DEFAULTS[@]}" \
  --out "$OUT/wna16.json" 2>&1 | tail -14 || true
step "done"
