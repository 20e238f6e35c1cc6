#!/usr/bin/env bash
# Device calls of round 37 (2026-12-06): what round 36 left unchecked, and float32 prefill
# attention's launch.
#   bash bench/run_r37.sh SHA checks   (about 6 minutes; results under $OUT; carry [".whl"])
#  1. the WNA16 tests of the default launches on the GPU (the transposed product chosen at
#     2-32 rows and equal to the reference, the code-pair GEMV at one row, the launch
#     tables, the integer checkpoints' CUDA-graph steps);
#  2. the CUDA-graph tests of captured steps (a drafted chunk among them) against eager
#     ones, which round 36's 110 s did not finish;
#  3. bench/tune_prefill.py --dtype float32: the prefill kernel's float32 launches over
#     round 36's drafted step (16 positions over 600 cached tokens) and the bf16 cases.
#   bash bench/run_r37.sh SHA prefill  step 3 alone, with 300 s
#   bash bench/run_r37.sh SHA fp32     (about 8 minutes) after float32's 16-row prefill tiles:
#     the prefill kernel's tests and the CUDA-graph tests on the GPU, round 36's drafted
#     float32 step (spec_step_probe.py) and speculative decoding in float32 (spec_decode.py)
#   bash bench/run_r37.sh SHA decode32 float32 decode launches (tune_decode.py --dtype
#     float32) and spec_step_probe.py's float32 steps (about 3 minutes)
#   bash bench/run_r37.sh SHA engine   round 30's engine runs (run_r30.sh SHA engine): a
#     random 4-bit GPTQ llama3-8b (groups of 128) and the fp16 dummy, batch-1 decode and
#     serving, with the integer defaults of round 35.
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?checks or engine}
OUT=${OUT:-/tmp/out}
export TPSERVE_GIT_COMMIT=$SHA
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [ "$PART" = checks ]; then
  step "float32 prefill launches"
  timeout 240 python3 bench/tune_prefill.py --dtype float32 --out "$OUT/prefill-fp32.json" \
    2>&1 | tail -45 | cut -c1-200 || true
  step "wna16 default-launch tests"
  wna16_default_tests
  step "captured graphs against eager steps (a drafted chunk among them)"
  timeout 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider --durations=12 \
    tests/model/test_cuda_graph_path.py -k "captured or drafted" 2>&1 | tail -20 || true
elif [ "$PART" = prefill ]; then
  timeout 300 python3 bench/tune_prefill.py --dtype float32 --out "$OUT/prefill-fp32.json" \
    2>&1 | cut -c1-220 || true
elif [ "$PART" = fp32 ]; then
  step "the prefill kernel's tests on the GPU (16-row float32 tiles among them)"
  timeout 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_kernels.py -k "prefill or graph_padding or 16_row" 2>&1 \
    | tail -4 || true
  step "captured graphs against eager steps (qwen3-0.6b's in float32, a drafted chunk)"
  timeout 240 python3 -m pytest -q -o addopts="" -p no:cacheprovider --durations=10 \
    tests/model/test_cuda_graph_path.py -k "captured or drafted" 2>&1 | tail -16 || true
  step "a drafted step, qwen3-0.6b float32 (round 36: 85.3 ms in the mixed graph)"
  timeout 60 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 2>&1 \
    | grep -v Warning | tail -10 | cut -c1-200 || true
  step "speculative decoding, qwen3-0.6b float32 (round 36: 0.32x / 0.35x)"
  timeout 120 python3 bench/spec_decode.py --git-commit "$SHA" --model qwen3-0.6b \
    --dtype float32 --requests 8 --output-len 96 --out "$OUT/spec-qwen3-0.6b-fp32.json" \
    2>&1 | grep -v Warning | tail -8 | cut -c1-300 || true
elif [ "$PART" = decode32 ]; then
  timeout 110 python3 bench/tune_decode.py --dtype float32 --out "$OUT/decode-fp32.json" \
    2>&1 | cut -c1-220 || true
  step "a decode step and a drafted one, qwen3-0.6b float32"
  timeout 60 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 2>&1 \
    | grep -v Warning | tail -6 | cut -c1-200 || true
elif [ "$PART" = engine ]; then
  OUT="$OUT" bash bench/run_r30.sh "$SHA" engine
fi
step "done"
