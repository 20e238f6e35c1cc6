#!/usr/bin/env bash
# Issue 15 round 5 on the H200, one device call:
#   tests: the fp8 decode-attention and CUDA-graph tests compiled on the GPU;
#   sweep: bench/time_fp8_decode.py --sweep --sweep-set r5 (the V scale in the widened V
#     tile at several tiles, against the launch without it), split counts x1 and x2;
#   sweep6: --sweep-set r6 (programs of one or two warps), split counts x1, x2, x4, x8;
#   sweep7: --sweep-set r7 (the one-warp and the small-grid FP8 launch) at batches 1-32;
#   both: bench_engine.py --serving-only for fp8 weights + KV alone;
#   dtests: only the decode-attention launches of the fp8 tests and the CUDA-graph tests;
#   decode: bench/time_fp8_decode.py at its default sizes (the shipped launches only);
#   final: bench_engine.py --serving-only (no profile) for fp8 weights + KV, fp8 KV,
#     fp8 weights and bf16 in one lease;
#   profile: the same for fp8 weights + KV with 400 profiled serving steps.
# Usage (on the GPU machine, from the repo root, .whl carried; everything is packed into
# OUT_DIR/r5.tgz, since a device call returns at most 8 files):
#   bash bench/run_fp8_r5.sh OUT_DIR GIT_SHA [tests] [dtests] [decode] [sweep] [sweep6] [sweep7] [both] [final] [profile]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests sweep" "${@:3}"
if has tests; then
  step "tests"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_triton_fp8_kv.py \
    tests/model/test_cuda_graph_path.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has dtests; then
  step "decode-attention and graph tests"
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_cuda_graph_path.py \
    "tests/model/test_triton_fp8_kv.py::test_decode_attention_over_fp8" > "$out/gpu-dtests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-dtests.txt" | tail -8
fi
if has decode; then
  step "decode attention, shipped launches"
  timeout 120 python3 bench/time_fp8_decode.py --out "$out/decode.json" > "$out/decode.log" 2>&1
  python3 - "$out/decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print({k: r[k] for k in ("batch", "context", "bf16_splits", "bf16_us", "fp8_splits",
                             "fp8_us", "speedup", "max_abs_diff")})
PY
fi
if has sweep6; then
  step "decode sweep r6"
  timeout 400 python3 bench/time_fp8_decode.py --sweep --sweep-set r6 --split-factors 2 4 8 \
    --sizes 64:1152,128:2048,16:2048 --out "$out/decode-r6.json" > "$out/decode-r6.log" 2>&1
  tail -1 "$out/decode-r6.log" | cut -c1-300
  sweep_summary "$out/decode-r6.json" 8
fi
if has sweep7; then
  step "decode sweep r7"
  timeout 200 python3 bench/time_fp8_decode.py --sweep --sweep-set r7 --split-factors 2 4 \
    --sizes 1:1152,2:1152,4:1152,8:1152,16:1152,32:1152 --out "$out/decode-r7.json" \
    > "$out/decode-r7.log" 2>&1
  tail -1 "$out/decode-r7.log" | cut -c1-300
  sweep_summary "$out/decode-r7.json" 8
fi
if has both; then
  step "engine both"; engine_mode "$out" both "$sha" 0
fi
if has sweep; then
  step "decode sweep r5"
  timeout 240 python3 bench/time_fp8_decode.py --sweep --sweep-set r5 --split-factors 2 \
    --sizes 64:1152,128:2048,16:2048,1:1152 --out "$out/decode-r5.json" > "$out/decode-r5.log" 2>&1
  tail -2 "$out/decode-r5.log" | cut -c1-300
  sweep_summary "$out/decode-r5.json" 8
fi
if has final; then
  for mode in both fp8kv fp8w bf16; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has profile; then
  mkdir -p "$out/prof"
  step "engine both, profiled"; engine_mode "$out/prof" both "$sha" 400
fi
round_pack
