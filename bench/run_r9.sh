#!/usr/bin/env bash
# Round 9 on the H200 (issue 15's serving target): decode attention with the query heads as
# the matmuls' columns (DecodeLaunch.heads_as_cols, FP8_LAUNCH's default now), one device
# call per invocation:
#   sweep: bench/time_fp8_decode.py --sweep --sweep-set r9 --split-factors 2 4 at the
#     engine's sizes;
#   ab: bench_engine.py --serving-only, fp8 weights + KV, twice each, alternating: this
#     checkout (columns) and a copy of it in /tmp/rows whose FP8_LAUNCH has the heads as
#     rows (round 8's launch; nothing else differs);
#   tests: the decode-attention tests (bf16 and fp8 caches, the column launches among them)
#     and the CUDA-graph tests, compiled on the GPU;
#   final: bench_engine.py --serving-only for bf16, fp8 KV, fp8 weights;
#   profile: fp8 weights + KV with 400 profiled serving steps.
# Usage (GPU machine, repo root, .whl carried; everything packed into OUT_DIR.tgz):
#   bash bench/run_r9.sh OUT_DIR GIT_SHA [sweep] [ab] [tests] [final] [profile]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "sweep ab tests" "${@:3}"
if has sweep; then
  step "decode sweep r9"
  timeout 240 python3 bench/time_fp8_decode.py --sweep --sweep-set r9 --split-factors 2 4 \
    --sizes 1:1152,8:1152,16:2048,64:1152,128:2048 --out "$out/decode-r9.json" \
    > "$out/decode-r9.log" 2>&1
  sweep_summary "$out/decode-r9.json" 6
fi
if has ab; then
  rm -rf /tmp/rows && mkdir -p /tmp/rows && cp -r tpserve bench /tmp/rows/
  python3 - <<'PY' || exit 1
p = "/tmp/rows/tpserve/model/kernels/triton_decode_attention.py"
s = open(p).read()
cols = "target_programs=1024,\n                          heads_as_cols=True)"
assert s.count(cols) == 1, "FP8_LAUNCH's definition moved: update run_r9.sh"
open(p, "w").write(s.replace(cols, "target_programs=1024)"))
PY
  for i in 1 2; do
    step "engine both, columns ($i)"; engine_mode "$out" "both" "$sha" 0
    mv "$out/engine-both.json" "$out/engine-both-cols$i.json"
    mv "$out/engine-both.log" "$out/engine-both-cols$i.log"
    step "engine both, rows ($i)"
    (cd /tmp/rows && PYTHONPATH=/tmp/site:/tmp/rows engine_mode "$out" "both" "$sha" 0)
    mv "$out/engine-both.json" "$out/engine-both-rows$i.json"
    mv "$out/engine-both.log" "$out/engine-both-rows$i.log"
  done
fi
if has tests; then
  step "tests"
  timeout 150 python3 -m pytest -q -rs -x -p no:cacheprovider -k "decode or graph" \
    tests/model/test_triton_kernels.py tests/model/test_triton_fp8_kv.py \
    tests/model/test_cuda_graph_path.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has final; then
  for mode in bf16 fp8kv fp8w; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has profile; then
  mkdir -p "$out/prof"
  step "engine both, profiled"; engine_mode "$out/prof" both "$sha" 400
fi
round_pack
