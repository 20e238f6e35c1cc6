#!/usr/bin/env bash
# The FP8 KV cache's start-up calibration (--calculate-kv-scales) on the GPU machine, the
# first of two back-to-back calls (the second: run_smollm2_gpu.sh, which needs this call's
# half of the SmolLM2 wheel; see there). Carry .whl and .smol/a.
#   bash bench/run_kvcal.sh OUT SHA [PART...]   parts: tests acc engine (default: all)
# tests: the calibration's GPU test (Triton kernels against the CPU torch reference);
# acc: fp8_accuracy.py on dummy Llama-3-8B at 2,000 tokens, fp8-kv and both, calibrated
# (the default) and with --no-calculate-kv-scales; engine: bench_engine.py --serving-only
# with fp8 weights + KV (start-up log with the calibrated scales, serving figures).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
mkdir -p /tmp/smolparts && cp .smol/a/part00 /tmp/smolparts/ || exit 1
round_start "$1" "$2" "tests acc engine" "${@:3}"
if has tests; then
  step "calibration GPU test"
  timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_kv_calibration.py \
    -k "gpu or ranks or runner or checkpoint or scale_maps" > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has acc; then
  for cal in calculate-kv-scales no-calculate-kv-scales; do
    step "accuracy dummy llama3-8b, 2,000 tokens, --$cal"
    timeout 150 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
      --device cuda --max-prompt-len 2000 --modes fp8-kv both --"$cal" --git-commit "$sha" \
      --out "$out/acc-dummy8b-$cal.json" > "$out/acc-dummy8b-$cal.log" 2>&1
    grep -E "^(base|fp8-kv|both) " "$out/acc-dummy8b-$cal.log" | cut -c1-600
  done
fi
if has engine; then
  step "engine, fp8 weights + KV"
  engine_mode "$out" both "$sha" 0
  grep -E "KV cache scales|scales calibrated" "$out/engine-both.log" | cut -c1-300
fi
round_pack
