#!/usr/bin/env bash
# One device call (round 34): GGUF's K-quant forms, new this session, on the GPU.
#   bash bench/run_r34.sh SHA
#  1. the Triton cache filled by 8 --compile-only workers;
#  2. the GPU tests of the new code: the mixed K-quant file (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1,
#     Q8_0 in one file) in CUDA graphs against eager and the CPU reference, and the two
#     GPU tests moved onto tests/model/util.graphs_and_eager (GGUF blocks, integer
#     checkpoints);
#  3. the forms a Q4_K_M file is served in, a llama3-8b layer's four products, M 1 .. 256,
#     the dequantized path beside them: 8-bit codes in groups of 16 with float offsets (a
#     q/k/v whose v is Q6_K) into $OUT/wna16-k8off.json and with a zero point (Q6_K alone)
#     into $OUT/wna16-k8.json; 4-bit codes in groups of 16 with offsets (Q2_K) into
#     $OUT/wna16-k4off16.json; Q4_K's (4 bits, groups of 32, offsets) is round 32's Q4_1.
# carry [".whl"].
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
K8OFF=(--group 16 --bits 8 --offset --m 1 4 16 64 256 --launch dequant)
K8=(--group 16 --bits 8 --m 1 4 16 64 256 --launch dequant)
K4=(--group 16 --bits 4 --offset --m 1 4 16 64 256 --launch dequant)
step "compile (8 workers)"
for w in 0 1 2 3 4 5 6 7; do
  (for args in "${K8OFF[*]}" "${K8[*]}" "${K4[*]}"; do
     # shellcheck disable=SC2086 # each set is split into its words on purpose
     timeout 120 python3 bench/time_wna16.py --compile-only $args --worker "$w/8" \
       > /dev/null 2>&1 || true
   done) &
done
wait
step "tests"
timeout 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE \
  tests/model/test_gguf_kquants.py tests/model/test_gguf_integer.py \
  tests/model/test_int_checkpoint.py -k "gpu or cuda_graphs" 2>&1 | tail -8 || true
step "8-bit, groups of 16, offsets"
timeout 90 python3 bench/time_wna16.py --git-commit "$SHA" "${K8OFF[@]}" \
  --out "$OUT/wna16-k8off.json" 2>&1 | tail -8 || true
step "8-bit, groups of 16, zero point"
timeout 90 python3 bench/time_wna16.py --git-commit "$SHA" "${K8[@]}" \
  --out "$OUT/wna16-k8.json" 2>&1 | tail -8 || true
step "4-bit, groups of 16, offsets"
timeout 90 python3 bench/time_wna16.py --git-commit "$SHA" "${K4[@]}" \
  --out "$OUT/wna16-k4off16.json" 2>&1 | tail -8 || true
step "done"
