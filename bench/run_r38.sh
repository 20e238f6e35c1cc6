#!/usr/bin/env bash
# Device calls of round 38 (2026-12-06): where a float32 decode step goes.
#   bash bench/run_r38.sh SHA profile  (about 3 minutes; carry [".whl"]) qwen3-0.6b's
#     decode and drafted steps timed (spec_step_probe.py) in float32 and bf16, then 5 decode
#     steps of each under torch.profiler (the GPU time by kernel): round 37 measured 6.8 ms
#     for the float32 step, whose 2.4 GB of weights take about 0.7 ms to read, while its
#     decode attention takes 13 us a layer
#   bash bench/run_r38.sh SHA args  (about 2 minutes) decode_args_probe.py in float32 and
#     bf16: the engine's first-layer decode launch as given and with each input replaced
#   bash bench/run_r38.sh SHA fp32  (about 8 minutes) after float32's FMA decode launch: the
#     decode kernel's tests on the GPU, tune_decode.py --dtype float32 (launches x split
#     counts), qwen3-0.6b's float32 steps (spec_step_probe.py, the decode one profiled) and
#     the captured-graph tests
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?profile, args or fp32}
OUT=${OUT:-/tmp/out}
export TPSERVE_GIT_COMMIT=$SHA
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [ "$PART" = profile ]; then
  for dtype in float32 bfloat16; do
    step "qwen3-0.6b $dtype: decode and drafted steps, then 5 decode steps profiled"
    timeout 120 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype "$dtype" \
      --profile 5 2>&1 | grep -v Warning | tail -26 | cut -c1-220 || true
  done
  step "qwen3-0.6b float32 eager: 5 decode steps profiled"
  timeout 120 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 \
    --profile 5 -- --enforce-eager 2>&1 | grep -v Warning | tail -40 | cut -c1-220 || true
elif [ "$PART" = fp32 ]; then
  step "the decode kernel's tests on the GPU (the FMA form among them)"
  timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_kernels.py -k "decode" 2>&1 | tail -4 || true
  step "qwen3-0.6b float32: decode and drafted steps, 5 decode steps profiled"
  timeout 90 python3 bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 \
    --profile 5 2>&1 | grep -v Warning | tail -26 | cut -c1-200 || true
  step "float32 decode launches x split counts"
  timeout 200 python3 bench/tune_decode.py --dtype float32 --out "$OUT/decode-fp32.json" \
    2>&1 | grep "^batch" || true
  step "captured graphs against eager steps (qwen3-0.6b's in float32 among them)"
  timeout 110 python3 -m pytest -q -o addopts="" -p no:cacheprovider --durations=5 \
    tests/model/test_cuda_graph_path.py -k "captured or drafted" 2>&1 | tail -10 || true
elif [ "$PART" = args ]; then
  for dtype in float32 bfloat16; do
    step "qwen3-0.6b $dtype: the engine's decode launch, its inputs replaced one at a time"
    timeout 150 python3 bench/decode_args_probe.py --model qwen3-0.6b --dtype "$dtype" \
      2>&1 | grep -v Warning | tail -40 | cut -c1-220 || true
  done
fi
step "done"
