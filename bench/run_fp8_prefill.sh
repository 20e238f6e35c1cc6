#!/usr/bin/env bash
# One device call (~5 min): prefill attention over an FP8 cache with bf16 vs fp16 operands
# (bench/tune_prefill.py --fp8), the FP8 KV tests compiled on the GPU, then bench_engine.py
# --serving-only --profile with --kv-cache-dtype fp8 and with fp8 weights + fp8 KV.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_prefill.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha
. "$(dirname "$0")/gpu_env.sh"
step "prefill attention sweep"
timeout 90 python3 bench/tune_prefill.py --fp8 --out "$out/fp8-prefill.json" \
  > "$out/fp8-prefill.log" 2>&1
cut -c1-400 "$out/fp8-prefill.log" | tail -4
step "fp8 KV tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_fp8_kv.py \
  > "$out/gpu-tests.txt" 2>&1
grep -E "passed|failed" "$out/gpu-tests.txt" | tail -1
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -10
for mode in fp8kv both; do
  flags=(--kv-cache-dtype fp8)
  [ "$mode" = both ] && flags+=(--quantization fp8)
  step "engine $mode"
  timeout 170 python3 bench/bench_engine.py --serving-only --profile \
    --out "$out/engine-$mode.json" --git-commit "$sha" "${flags[@]}" \
    > "$out/engine-$mode.log" 2>&1
  grep -E "batch-1|serving:" "$out/engine-$mode.log" | cut -c1-220
done
step done
