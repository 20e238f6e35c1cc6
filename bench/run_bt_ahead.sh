#!/usr/bin/env bash
# Decode attention with the block table a tile ahead (DecodeLaunch.bt_ahead) on the GPU
# machine. Carry .whl.
#   bash bench/run_bt_ahead.sh OUT SHA [PART...]   parts: timing tests engine (default: timing)
# timing: bench/time_decode_bt_ahead.py; tests: the decode-attention and CUDA-graph tests
# compiled on the GPU; engine: bench_engine.py --serving-only, fp8 weights + KV and bf16.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "timing" "${@:3}"
if has timing; then
  step "decode attention, block table a tile ahead"
  timeout 300 python3 bench/time_decode_bt_ahead.py --out "$out/bt-ahead.json" \
    > "$out/bt-ahead.log" 2>&1
  python3 - "$out/bt-ahead.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    for cache in ("bf16", "fp8"):
        got = sorted((v["us"], k[len(cache) + 1:], v["splits"], v["diff"]) for k, v in r.items()
                     if k.startswith(cache + "_") and isinstance(v, dict))
        base = r.get(cache + "_default", {}).get("us")
        print(r["batch"], r["context"], cache, "default", base, "| best:", got[:4])
    bad = [k for k, v in r.items() if isinstance(v, str)]
    if bad:
        print("   failed:", bad)
PY
  tail -3 "$out/bt-ahead.log" | cut -c1-300
fi
if has tests; then
  step "decode attention and graph tests"
  timeout 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_triton_kernels.py \
    tests/model/test_triton_fp8_kv.py tests/model/test_cuda_graph_path.py -k "decode or graph" \
    > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
if has engine; then
  for mode in both bf16; do
    step "engine $mode"
    engine_mode "$out" "$mode" "$2" 0
  done
fi
round_pack
