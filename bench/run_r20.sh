#!/usr/bin/env bash
# Round 20 (issue 15) on the GPU machine: where per-channel fp8 decode steps should switch
# from weight-only products to W8A8.
#   bash bench/run_r20.sh OUT SHA [PART...]   parts: gemm serve (default: both)
# gemm: bench/fp8_gemm.py at the decode graphs' token buckets (weight-only against the Triton
# W8A8 kernel, one layer's four products). serve: closed-loop serving of dummy llama3-8b with
# fp8 weights + KV at concurrency C32 (default 32; 10 x C32 prompts), alternating
# --fp8-weight-only-max-tokens 32 (the default) and WO_ALT (default 8), SERVE_ROUNDS rounds
# (default 2).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "gemm serve" "${@:3}"
if has gemm; then
  step "weight-only against W8A8 at the decode buckets"
  timeout 300 python3 bench/fp8_gemm.py --m 4 8 16 32 48 64 --out "$out/fp8-gemm.json" \
    --commit "$2" > "$out/fp8-gemm.log" 2>&1
  grep -A12 "per-M sum" "$out/fp8-gemm.log"; grep -m3 -i error "$out/fp8-gemm.log" | cut -c1-600
fi
if has serve; then
  c=${C32:-32}
  for ((i = 1; i <= ${SERVE_ROUNDS:-2}; i++)); do
    for wo in 32 "${WO_ALT:-8}"; do
      step "serving c=$c, weight-only up to $wo tokens, round $i"
      timeout 150 python3 bench/bench_engine.py --serving-only --quantization fp8 \
        --kv-cache-dtype fp8 --concurrency "$c" --num-prompts $((10 * c)) \
        --fp8-weight-only-max-tokens "$wo" --out "$out/engine-c$c-wo$wo-$i.json" \
        --git-commit "$2" > "$out/engine-c$c-wo$wo-$i.log" 2>&1
      grep -E "batch-1|serving:|GPU while" "$out/engine-c$c-wo$wo-$i.log" | cut -c1-400
    done
  done
fi
round_pack
