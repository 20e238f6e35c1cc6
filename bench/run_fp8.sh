#!/usr/bin/env bash
# One device call for --quantization fp8 (about 9 minutes at most): the fp8 kernel tests on
# the GPU, the GEMM sweep (bf16, Triton weight-only, fused quant + _scaled_mm), the engine
# benchmark bf16 then fp8 (serving-only figures), then the accuracy script on dummy
# llama3-8b. Each step has its own timeout, so one failure does not sink the rest.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,utilization.gpu \
  --format=csv > "$out/nvidia-smi.csv"
step() { echo "=== $1 ($(date +%T))"; }
step "fp8 kernel and layer tests"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_kernels.py \
  tests/model/test_fp8.py tests/model/test_fp8_layers.py 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
step "GEMM sweep"
timeout 100 python3 bench/fp8_gemm.py --out "$out/fp8-gemm.json" --commit "$sha" --iters 30 \
  > "$out/fp8-gemm.log" 2>&1; tail -3 "$out/fp8-gemm.log"
common=(--git-commit "$sha" --serving-only --skip-profile --num-prompts 384
        --serving-time-limit 45 --decode-output-len 128)
step "engine bf16"
timeout 130 python3 bench/bench_engine.py --out "$out/engine-bf16.json" "${common[@]}" \
  > "$out/engine-bf16.log" 2>&1; grep -E "batch-1|serving|weights" "$out/engine-bf16.log" | head
step "engine fp8"
timeout 130 python3 bench/bench_engine.py --out "$out/engine-fp8.json" "${common[@]}" \
  --quantization fp8 > "$out/engine-fp8.log" 2>&1
grep -E "batch-1|serving|weights" "$out/engine-fp8.log" | head
step "accuracy, dummy llama3-8b"
timeout 80 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
  --max-prompt-len 2000 --decode-tokens 16 --git-commit "$sha" --out "$out/fp8-accuracy.json" \
  > "$out/fp8-accuracy.log" 2>&1; tail -5 "$out/fp8-accuracy.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,utilization.gpu \
  --format=csv,noheader >> "$out/nvidia-smi.csv"
step done
