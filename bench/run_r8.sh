#!/usr/bin/env bash
# Round 8 on the H200 (issue 15's serving target): the decode kernel's running maximum moved
# lazily (DecodeLaunch.lazy_rescale), one device call per invocation:
#   tests: the decode-attention tests (bf16 and fp8 caches, the lazy launch among them) and
#     the CUDA-graph tests, compiled on the GPU;
#   sweep: bench/time_fp8_decode.py --sweep --sweep-set r8 --split-factors 2 4 at the
#     engine's sizes;
#   final: bench_engine.py --serving-only for fp8 weights + KV, bf16, fp8 KV, fp8 weights;
#   profile: fp8 weights + KV with 400 profiled serving steps.
# Usage (GPU machine, repo root, .whl carried; everything packed into OUT_DIR.tgz):
#   bash bench/run_r8.sh OUT_DIR GIT_SHA [tests] [sweep] [final] [profile]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests sweep" "${@:3}"
if has tests; then
  step "tests"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -k "decode or lazy or graph" \
    tests/model/test_triton_kernels.py tests/model/test_triton_fp8_kv.py \
    tests/model/test_cuda_graph_path.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has sweep; then
  step "decode sweep r8"
  timeout 300 python3 bench/time_fp8_decode.py --sweep --sweep-set r8 --split-factors 2 4 \
    --sizes 8:1152,16:2048,32:1152,64:1152,128:2048 --out "$out/decode-r8.json" \
    > "$out/decode-r8.log" 2>&1
  sweep_summary "$out/decode-r8.json" 8
fi
if has final; then
  for mode in both bf16 fp8kv fp8w; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has profile; then
  mkdir -p "$out/prof"
  step "engine both, profiled"; engine_mode "$out/prof" both "$sha" 400
fi
round_pack
