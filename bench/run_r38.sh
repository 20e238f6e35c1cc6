#!/usr/bin/env bash
# Device calls of round 38 (2026-12-06): where a float32 decode step goes.
#   bash bench/run_r38.sh SHA profile  (about 3 minutes; carry [".whl"]) qwen3-0.6b's
#     decode and drafted steps timed (spec_step_probe.py) in float32 and bf16, then 5 decode
#     steps of each under torch.profiler (the GPU time by kernel): round 37 measured 6.8 ms
#     for the float32 step, whose 2.4 GB of weights take about 0.7 ms to read, while its
#     decode attention takes 13 us a layer
#   bash bench/run_r38.sh SHA args  (about 2 minutes) decode_args_probe.py in float32 and
#     bf16: the engine's first-layer decode launch as given and with each input replaced
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?profile}
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
elif [ "$PART" = args ]; then
  for dtype in float32 bfloat16; do
    step "qwen3-0.6b $dtype: the engine's decode launch, its inputs replaced one at a time"
    timeout 150 python3 bench/decode_args_probe.py --model qwen3-0.6b --dtype "$dtype" \
      2>&1 | grep -v Warning | tail -40 | cut -c1-220 || true
  done
fi
step "done"
