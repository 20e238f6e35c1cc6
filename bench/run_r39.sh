#!/usr/bin/env bash
# Device calls of round 39 (2026-12-06): float32 speculation after round 38's decode launch.
#   bash bench/run_r39.sh SHA fp32  (about 5 minutes; carry [".whl"]; results under $OUT)
#  1. qwen3-0.6b's decode and drafted steps (spec_step_probe.py) in float32 and bf16, the
#     1- and 5-token steps profiled (the GPU time by kernel): round 38 made the float32
#     decode step 3.2x faster (2.08 ms) but left its drafted steps at 7.4-7.7 ms;
#  2. speculative decoding in float32 (spec_decode.py), round 37's run again: its 2.41x /
#     2.31x were measured against the old, slower decode step.
#   bash bench/run_r39.sh SHA verify  (about 7 minutes) after a drafted chunk's positions
#     became decodes (StepPlan.build): the captured-graph tests, the steps of part fp32
#     (the 5-token one profiled), speculative decoding in float32 (qwen3-0.6b) and bf16
#     (llama3-8b, round 36's run)
#   bash bench/run_r39.sh SHA backoff  (about 5 minutes) with drafting paused where it keeps
#     too little (draft_backoff.py): part verify's two speculative runs again
#   bash bench/run_r39.sh SHA llama  (about 2 minutes) dummy llama3-8b's decode and drafted
#     steps in bf16 (spec_step_probe.py; round 36: a drafted step 1.14x a decode step)
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?fp32}
OUT=${OUT:-/tmp/out}
export TPSERVE_GIT_COMMIT=$SHA
mkdir -p "$OUT" && exec > >(tee "$OUT/r39-$PART.txt") 2>&1  # the output comes back whole
# spec MODEL DTYPE TAG OUTPUT_LEN SECONDS: spec_decode.py over 8 requests into
# $OUT/spec-MODEL-TAG.json, its rows printed
spec() {
  timeout "$5" python3 bench/spec_decode.py --git-commit "$SHA" --model "$1" --dtype "$2" \
    --requests 8 --output-len "$4" --out "$OUT/spec-$1-$3.json" 2>&1 | grep -v Warning \
    | tail -8 | cut -c1-300 || true
}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [ "$PART" = fp32 ]; then
  for dtype in float32 bfloat16; do
    step "qwen3-0.6b $dtype: decode and drafted steps, the 1- and 5-token steps profiled"
    timeout 120 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype "$dtype" \
      --profile 5 --profile-tokens 1 5 2>&1 | grep -v Warning | tail -45 | cut -c1-220 || true
  done
  step "speculative decoding, qwen3-0.6b float32 (round 37: 2.41x / 2.31x)"
  spec qwen3-0.6b float32 fp32 96 150
elif [ "$PART" = verify ]; then
  step "captured graphs against eager steps (drafted chunks as decodes, and beside a prompt)"
  timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider --durations=5 \
    tests/model/test_cuda_graph_path.py -k "captured or drafted" 2>&1 | tail -10 || true
  for dtype in float32 bfloat16; do
    step "qwen3-0.6b $dtype: decode and drafted steps, the 5-token step profiled"
    timeout 90 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype "$dtype" \
      --profile 5 --profile-tokens 5 2>&1 | grep -v Warning | tail -26 | cut -c1-200 || true
  done
  step "speculative decoding, qwen3-0.6b float32"
  spec qwen3-0.6b float32 fp32 96 100
  step "speculative decoding, llama3-8b bf16 (round 36: 0.95x / 0.92x, no draft kept)"
  spec llama3-8b bfloat16 bf16 128 150
elif [ "$PART" = backoff ]; then
  step "speculative decoding, llama3-8b bf16 (call 2: 0.95x / 0.89x, no draft kept)"
  spec llama3-8b bfloat16 bf16 128 150
  step "speculative decoding, qwen3-0.6b float32 (call 2: 1.15-2.0x)"
  spec qwen3-0.6b float32 fp32 96 100
elif [ "$PART" = llama ]; then
  step "llama3-8b bfloat16: decode and drafted steps, the 5-token step profiled"
  timeout 200 python3 bench/spec_step_probe.py --model llama3-8b --dtype bfloat16 \
    --profile 5 --profile-tokens 1 5 2>&1 | grep -v Warning | tail -45 | cut -c1-200 || true
fi
step "done"
