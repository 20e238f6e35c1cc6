#!/usr/bin/env bash
# Round 20 (issue 15) on the GPU machine: where per-channel fp8 decode steps should switch
# from weight-only products to W8A8.
#   bash bench/run_r20.sh OUT SHA [PART...]   parts: tests gemm blockgemm serve c64
#   (default: gemm serve)
# tests: the GPU tests of the fp8 kernels, fused producers and CUDA graphs. gemm:
# bench/fp8_gemm.py at the decode graphs' token buckets (weight-only against the Triton W8A8
# kernel, one layer's four products). blockgemm: bench/fp8_block_gemm.py at the same buckets
# (per-channel and block-wise layers as served). serve: closed-loop serving of dummy
# llama3-8b with fp8 weights + KV at concurrency C (default 32; 10 x C prompts), for each
# --fp8-weight-only-max-tokens in WOS (default "32 8"), SERVE_ROUNDS rounds (default 2).
# c64: the issue's serving workload (c = 64), fp8 weights + KV, the server's defaults.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "gemm serve" "${@:3}"
if has tests; then
  step "fp8 kernel, fused-producer and CUDA-graph tests"
  timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_fp8_kernels.py tests/model/test_triton_w8a8.py tests/model/test_fp8_fused.py \
    tests/model/test_fp8_block.py tests/model/test_cuda_graph_path.py > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
if has gemm; then
  step "weight-only against W8A8 at the decode buckets"
  timeout 300 python3 bench/fp8_gemm.py --m 4 8 16 32 48 64 --out "$out/fp8-gemm.json" \
    --commit "$2" > "$out/fp8-gemm.log" 2>&1
  grep -A12 "per-M sum" "$out/fp8-gemm.log"; grep -m3 -i error "$out/fp8-gemm.log" | cut -c1-600
fi
if has blockgemm; then
  step "per-channel and block-wise layers at the decode buckets"
  timeout 200 python3 bench/fp8_block_gemm.py --m 1 2 4 8 16 32 64 \
    --out "$out/fp8-block-gemm.json" --commit "$2" > "$out/fp8-block-gemm.log" 2>&1
  grep -A10 "^     M" "$out/fp8-block-gemm.log"; grep -m3 error "$out/fp8-block-gemm.log" | cut -c1-600
fi
if has serve; then
  c=${C:-32}
  for ((i = 1; i <= ${SERVE_ROUNDS:-2}; i++)); do
    for wo in ${WOS:-32 8}; do
      step "serving c=$c, weight-only up to $wo tokens, round $i"
      timeout 150 python3 bench/bench_engine.py --serving-only --quantization fp8 \
        --kv-cache-dtype fp8 --concurrency "$c" --num-prompts $((10 * c)) \
        --fp8-weight-only-max-tokens "$wo" --out "$out/engine-c$c-wo$wo-$i.json" \
        --git-commit "$2" > "$out/engine-c$c-wo$wo-$i.log" 2>&1
      grep -E "batch-1|serving:|GPU while" "$out/engine-c$c-wo$wo-$i.log" | cut -c1-400
    done
  done
fi
if has c64; then
  step "serving c=64, fp8 weights + KV, defaults"
  engine_mode "$out" both "$2" 0
fi
round_pack
