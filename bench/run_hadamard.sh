#!/usr/bin/env bash
# The FP8 KV cache's Hadamard rotation of K (--kv-cache-hadamard) on the GPU machine, the
# first of two back-to-back calls (the second: run_smollm2_gpu.sh, which needs this call's
# half of the SmolLM2 wheel; see there). Carry .whl and .smol/a.
#   bash bench/run_hadamard.sh OUT SHA [PART...]   parts: tests acc timing engine (default: all)
# tests: the rotation's kernel tests and the FP8 / RoPE kernel tests (Triton compiled,
# against the torch reference); acc: fp8_accuracy.py on dummy Llama-3-8B at 2,000 tokens,
# fp8-kv and both, with and without the rotation; timing: bench/time_rope_hadamard.py; engine: bench_engine.py --serving-only
# with fp8 weights + KV, rotation on / off / on / off (the lease's drift shows in the pairs).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
mkdir -p /tmp/smolparts && cp .smol/a/part00 /tmp/smolparts/ || exit 1
round_start "$1" "$2" "tests acc timing engine" "${@:3}"
if has tests; then
  step "kernel tests"
  timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_triton_kv_hadamard.py \
    tests/model/test_kv_hadamard.py tests/model/test_triton_fp8_kv.py \
    tests/model/test_triton_kernels.py -k "hadamard or rope or resolution or signs or refused" \
    > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has acc; then
  for had in kv-cache-hadamard no-kv-cache-hadamard; do
    step "accuracy dummy llama3-8b, 2,000 tokens, --$had"
    timeout 150 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
      --device cuda --max-prompt-len 2000 --modes fp8-kv both --"$had" --git-commit "$sha" \
      --out "$out/acc-dummy8b-$had.json" > "$out/acc-dummy8b-$had.log" 2>&1
    grep -E "^(base|fp8-kv|both) " "$out/acc-dummy8b-$had.log" | cut -c1-600
  done
fi
if has timing; then
  step "the RoPE + KV write kernel, rotation off / on"
  timeout 120 python3 bench/time_rope_hadamard.py --out "$out/rope-hadamard.json" \
    > "$out/rope-hadamard.log" 2>&1
  cat "$out/rope-hadamard.log" | cut -c1-200
fi
if has engine; then
  for mode in both both-nohad; do
    step "engine, $mode"
    engine_mode "$out" "$mode" "$sha" 0
  done
  for mode in both both-nohad; do
    step "engine, $mode (again)"
    cp "$out/engine-$mode.json" "$out/engine-$mode-1.json"
    cp "$out/engine-$mode.log" "$out/engine-$mode-1.log"
    engine_mode "$out" "$mode" "$sha" 0
  done
  grep -h "K Hadamard\|K not rotated" "$out"/engine-both*.log | cut -c1-300 | sort -u
fi
round_pack
