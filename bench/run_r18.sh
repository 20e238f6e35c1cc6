#!/usr/bin/env bash
# Round 18 (issue 15) on the GPU machine: FP8 checkpoints with static activation scales.
# Carry .whl (with .whl/r18-fusion.patch: `git diff BASE HEAD -- tpserve`, made before the
# call, BASE the commit before the static quantization was fused into the producers).
#   bash bench/run_r18.sh OUT SHA [PART...]   parts: tests serving block_tests block
#   (default: tests serving)
# tests: the GPU tests of the files this round touched; serving: a static FP8 checkpoint of
# dummy llama3-8b (bench/make_fp8_checkpoint.py), served with an fp8 KV cache, alternating
# this tree (static quantization fused into the norms and the SiLU gate) and a copy with
# the patch reversed (one quantizer kernel before each W8A8 product), then per-token dynamic
# fp8 (`--quantization fp8` on the dummy bf16 weights), two rounds. block_tests: the GPU
# tests of block-wise FP8 checkpoints; block: a block-wise ([128, 128]) FP8 checkpoint of
# dummy llama3-8b served with an fp8 KV cache, alternating with per-token dynamic fp8,
# BLOCK_ROUNDS rounds (default 2; BLOCK_DYNAMIC=0: the block runs only; BLOCK_PROFILE=N: the
# block runs profile N serving steps).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests serving" "${@:3}"
# static_run DIR NAME TREE SHA [CKPT [PROFILE_STEPS]]: checkpoint_run on the static (or
# CKPT) checkpoint
static_run() {
  checkpoint_run "$1" "$2" "$3" "$4" "${5:-/tmp/llama3-8b-fp8-static}" "${6:-0}"
}
if has tests; then
  step "fp8 fused, quantizer, W8A8 and checkpoint tests"
  timeout 240 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_fp8_fused.py tests/model/test_fp8_kernels.py \
    tests/model/test_triton_w8a8.py tests/model/test_fp8_checkpoint.py \
    tests/model/test_fp8_layers.py > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
if has serving; then
  step "static FP8 checkpoint of dummy llama3-8b"
  timeout 200 python3 bench/make_fp8_checkpoint.py --shape llama3-8b \
    --out /tmp/llama3-8b-fp8-static > "$out/make-checkpoint.log" 2>&1
  cat "$out/make-checkpoint.log" | tail -3
  base=/tmp/r18-base
  rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r18-fusion.patch) \
    || exit 1
  for i in 1 2; do
    step "static fused-$i"
    static_run "$out" "static-fused-$i" . "$2"
    step "static unfused-$i"
    static_run "$out" "static-unfused-$i" "$base" "$2-r18-fusion.patch"
    step "dynamic-$i"
    engine_mode "$out" "both_dynamic-$i" "$2" 0
  done
fi
if has block_tests; then
  step "block-wise FP8 tests"
  timeout 240 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_fp8_block.py tests/model/test_fp8_block.py \
    > "$out/gpu-tests-block.txt" 2>&1
  tail -3 "$out/gpu-tests-block.txt"
fi
if has block; then
  step "block-wise FP8 checkpoint of dummy llama3-8b"
  timeout 200 python3 bench/make_fp8_checkpoint.py --shape llama3-8b --block 128 128 \
    --out /tmp/llama3-8b-fp8-block > "$out/make-block-checkpoint.log" 2>&1
  tail -3 "$out/make-block-checkpoint.log"
  for ((i = 1; i <= ${BLOCK_ROUNDS:-2}; i++)); do
    step "block-$i"
    static_run "$out" "block-$i" . "$2" /tmp/llama3-8b-fp8-block "${BLOCK_PROFILE:-0}"
    [ "${BLOCK_DYNAMIC:-1}" = 0 ] && continue
    step "dynamic-$i"
    engine_mode "$out" "both_dynamic-block-round-$i" "$2" 0
  done
fi
round_pack
