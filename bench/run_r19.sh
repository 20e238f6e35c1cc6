#!/usr/bin/env bash
# Round 19 (issue 15) on the GPU machine: block-wise FP8 checkpoints' decode products through
# the tuned weight-only launches (block scales in their K loop).
#   bash bench/run_r19.sh OUT SHA [PART...]   parts: tests gemm block ab wo (default: tests gemm block)
# tests: the GPU tests of the kernels this round touched; gemm: bench/fp8_block_gemm.py (one
# layer's products, per-channel vs block-wise, cuBLAS's block scaling beside the Triton
# kernel; GEMM_SWEEP=1: with --sweep, the Triton block GEMM's launches at 33-64 tokens); block:
# the block-wise ([128, 128]) checkpoint of dummy llama3-8b served with an fp8
# KV cache, BLOCK_PROFILE serving steps profiled (default 400); ab: AB_ROUNDS rounds (default
# 2) alternating this tree and a copy with .whl/r19.patch reversed (carry it: `git diff BASE
# HEAD -- tpserve`), then per-token dynamic fp8 once. wo: the per-channel weight-only kernels
# (bench/fp8_gemm.py at M = 1, 2) and per-token dynamic fp8 serving, this tree against the
# copy with the patch reversed, alternating.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests gemm block" "${@:3}"
# serve DIR NAME TREE SHA [PROFILE_STEPS]: checkpoint_run on the block-wise checkpoint
serve() {
  checkpoint_run "$1" "$2" "$3" "$4" /tmp/llama3-8b-fp8-block "${5:-0}"
}
if has tests; then
  step "block-wise, weight-only and W8A8 kernel tests"
  timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_fp8_block.py tests/model/test_fp8_block.py \
    tests/model/test_fp8_kernels.py tests/model/test_triton_w8a8.py \
    > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
if has gemm; then
  step "block-wise against per-channel products"
  timeout 400 python3 bench/fp8_block_gemm.py --out "$out/fp8-block-gemm.json" \
    --commit "$2" ${GEMM_SWEEP:+--sweep} > "$out/fp8-block-gemm.log" 2>&1
  grep -A20 "^     M" "$out/fp8-block-gemm.log"; grep -m3 error "$out/fp8-block-gemm.log" | cut -c1-600
fi
if has block || has ab; then
  step "block-wise FP8 checkpoint of dummy llama3-8b"
  timeout 200 python3 bench/make_fp8_checkpoint.py --shape llama3-8b --block 128 128 \
    --out /tmp/llama3-8b-fp8-block > "$out/make-block-checkpoint.log" 2>&1
  tail -1 "$out/make-block-checkpoint.log"
fi
if has block; then
  step "block"
  serve "$out" block . "$2" "${BLOCK_PROFILE:-400}"
fi
if has ab || has wo; then
  base=/tmp/r19-base
  rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r19.patch) || exit 1
fi
if has ab; then
  for ((i = 1; i <= ${AB_ROUNDS:-2}; i++)); do
    step "block new-$i"; serve "$out" "block-new-$i" . "$2"
    step "block base-$i"; serve "$out" "block-base-$i" "$base" "$2-r19.patch"
  done
  step "dynamic"
  engine_mode "$out" both_dynamic "$2" 0
fi
if has wo; then
  for i in 1 2; do
    for spec in "new:." "base:$base"; do
      name=${spec%%:*} tree=${spec#*:}
      step "weight-only kernels $name-$i"
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 120 python3 bench/fp8_gemm.py --m 1 2 \
        --out "$out/fp8-gemm-$name-$i.json" --commit "$2-$name" > "$out/fp8-gemm-$name-$i.log" 2>&1)
      grep -A3 "per-M sum" "$out/fp8-gemm-$name-$i.log"
    done
  done
  step "dynamic new"
  engine_mode "$out" both_dynamic-new "$2" 0
  step "dynamic base"
  (cd "$base" && PYTHONPATH=/tmp/site:$base engine_mode "$out" both_dynamic-base "$2-r19.patch" 0)
fi
round_pack
