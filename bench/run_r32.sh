#!/usr/bin/env bash
# One device call (round 32, 2026-12-05): the WNA16 launches round 31 left untimed.
#   bash bench/run_r32.sh SHA
#  1. the Triton cache filled by 8 --compile-only workers;
#  2. the dequantized path whole and in chunks of 512 .. 4,096 output columns (a scratch
#     that stays in L2) at M 128 .. 2,048 (4-bit, groups of 128) into $OUT/wna16-chunks.json;
#  3. GGUF's blocks as served by --quantization gguf (groups of 32): Q8_0 / Q4_0 (integer
#     zero points, 8 / 4 bits) into $OUT/wna16-gguf.json and Q4_1 (float offsets, --offset)
#     into $OUT/wna16-gguf-offset.json, M 1 .. 256, the dequantized path beside them;
#  4. the GPU tests round 31 could not run: the float32 launches (the shared-memory fix),
#     the column chunks, the float offsets, the embedded SmolLM2 served as stored in CUDA
#     graphs, and the integer checkpoints' float32 CUDA-graph case.
# carry [".whl"].
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
CHUNKS=(--bits 4 --m 128 256 512 2048 --launch dequant dequant,0,512,0,1,0
        dequant,0,1024,0,1,0 dequant,0,2048,0,1,0 dequant,0,4096,0,1,0)
GGUF=(--group 32 --bits 8 4 --m 1 16 64 256 --launch dequant)
Q41=(--group 32 --bits 4 --offset --m 1 16 64 256 --launch dequant)
step "compile (8 workers)"
for w in 0 1 2 3 4 5 6 7; do
  (for args in "${CHUNKS[*]}" "${GGUF[*]}" "${Q41[*]}"; do
     # shellcheck disable=SC2086 # each set is split into its words on purpose
     timeout 120 python3 bench/time_wna16.py --compile-only $args --worker "$w/8" \
       > /dev/null 2>&1 || true
   done) &
done
wait
step "chunks"
timeout 120 python3 bench/time_wna16.py --git-commit "$SHA" "${CHUNKS[@]}" \
  --out "$OUT/wna16-chunks.json" 2>&1 | tail -6 || true
step "gguf Q8_0 / Q4_0"
timeout 90 python3 bench/time_wna16.py --git-commit "$SHA" "${GGUF[@]}" \
  --out "$OUT/wna16-gguf.json" 2>&1 | tail -6 || true
step "gguf Q4_1"
timeout 60 python3 bench/time_wna16.py --git-commit "$SHA" "${Q41[@]}" \
  --out "$OUT/wna16-gguf-offset.json" 2>&1 | tail -6 || true
step "tests"
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_triton_wna16.py tests/model/test_gguf_integer.py \
  -k "equals_the_dequantized_product and 33 and float32 or float32_keeps or column_chunks \
      or float_offsets or gpu_kernels" 2>&1 | tail -4 || true
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_int_checkpoint.py -k "cuda_graphs and float32" 2>&1 | tail -3 || true
step "done"
