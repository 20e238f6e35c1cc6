#!/usr/bin/env bash
# One device call (round 36, 2026-12-05): round 35's integer-weight defaults checked and
# measured in the engine.
#   bash bench/run_r36.sh SHA   (results under $OUT; carry [".whl"])
#  1. the WNA16 tests of the default launches on the GPU: the transposed product chosen
#     at 2-32 rows and equal to the reference, the code-pair GEMV at one row, the launch
#     tables, the integer checkpoints' CUDA-graph steps;
#  2. round 30's engine runs (run_r30.sh SHA engine): a random 4-bit GPTQ llama3-8b
#     (groups of 128) and the fp16 dummy, batch-1 decode and serving, same call.
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
step "wna16 default-launch tests"
timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_triton_wna16.py tests/model/test_int_checkpoint.py \
  -k "2_to_32 or one_row or gemv or launch or cuda_graphs or transposed" 2>&1 \
  | tail -8 || true
OUT="$OUT" bash bench/run_r30.sh "$SHA" engine
