#!/usr/bin/env bash
# One device call (round 36, 2026-12-05): speculative decoding by prompt lookup measured,
# and round 35's integer-weight defaults checked and measured in the engine.
#   bash bench/run_r36.sh SHA [all|short]   (results under $OUT; carry [".whl"]; short:
#   steps 1-3 only, about 5 minutes; spec: steps 2-3)
#  1. the WNA16 tests of the default launches on the GPU: the transposed product chosen
#     at 2-32 rows and equal to the reference, the code-pair GEMV at one row, the launch
#     tables, the integer checkpoints' CUDA-graph steps;
#  2. bench/spec_decode.py: dummy qwen3-0.6b in float32 (every request's greedy tokens
#     must equal the run without speculation), then dummy llama3-8b in bf16 (speed);
#  3. the CUDA-graph tests (captured steps, a drafted chunk among them, against eager);
#  4. round 30's engine runs (run_r30.sh SHA engine): a random 4-bit GPTQ llama3-8b
#     (groups of 128) and the fp16 dummy, batch-1 decode and serving, same call.
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
PART=${2:-all}
if [ "$PART" != spec ]; then
step "wna16 default-launch tests"
wna16_default_tests
fi
step "speculative decoding, qwen3-0.6b float32 (equality)"
timeout 90 python3 bench/spec_decode.py --git-commit "$SHA" --model qwen3-0.6b \
  --dtype float32 --requests 8 --output-len 96 --out "$OUT/spec-qwen3-0.6b-fp32.json" \
  2>&1 | grep -v Warning | tail -8 | cut -c1-300 || true
step "speculative decoding, llama3-8b bf16 (speed)"
timeout 150 python3 bench/spec_decode.py --git-commit "$SHA" --model llama3-8b \
  --dtype bfloat16 --requests 8 --output-len 128 --out "$OUT/spec-llama3-8b-bf16.json" \
  2>&1 | grep -v Warning \
  | tail -8 | cut -c1-300 || true
step "captured graphs against eager steps (a drafted chunk among them)"
timeout 110 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_cuda_graph_path.py -k "captured or drafted" 2>&1 | tail -4 || true
[ "$PART" = all ] && OUT="$OUT" bash bench/run_r30.sh "$SHA" engine
step "done"
