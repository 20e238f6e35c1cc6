#!/usr/bin/env bash
# Decode attention with the block table a tile ahead (DecodeLaunch.bt_ahead) on the GPU
# machine. Carry .whl.
#   bash bench/run_bt_ahead.sh OUT SHA [PART...]   parts: timing tests engine ab ncu pool
#   dmon (default: timing)
# timing: bench/time_decode_bt_ahead.py; tests: the decode-attention and CUDA-graph tests
# compiled on the GPU; engine: bench_engine.py --serving-only, fp8 weights + KV and bf16;
# ab: fp8 weights + KV three times, alternating this tree and a copy with the fp8 decode
# launch before bt_ahead (32-key tiles, 3 stages); with profile: one profiled run (400 steps)
# of each instead; ncu: ncu_kernels.py --no-gemm under ncu; pool: the timing with the
# blocks drawn from an engine-sized pool; dmon: fp8 weights + KV serving with nvidia-smi dmon
# (SM clock, power) beside it.
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
if has engine; then
  for mode in both bf16; do
    step "engine $mode"
    engine_mode "$out" "$mode" "$2" 0
  done
fi
if has ab; then
  old=/tmp/before-bt-ahead
  rm -rf "$old" && cp -r . "$old"
  sed -i 's/^FP8_LAUNCH = DecodeLaunch(16, 1, 4, True, scale_v=True, target_programs=1024, bt_ahead=True)$/FP8_LAUNCH = DecodeLaunch(32, 1, 3, True, scale_v=True, target_programs=1024)/' \
    "$old/tpserve/model/kernels/triton_decode_attention.py"
  grep -n "^FP8_LAUNCH" "$old/tpserve/model/kernels/triton_decode_attention.py"
  runs=(new-1 before-1 new-2)
  has profile && runs=(new-p before-p) prof=400
  for run in "${runs[@]}"; do
    step "engine both, $run"
    if [[ $run == new-* ]]; then
      engine_mode "$out" "both_$run" "$2" "${prof:-0}"
    else
      (cd "$old" && PYTHONPATH=/tmp/site:$old engine_mode "$out" "both_$run" "$2+fp8-launch-of-1a96c1a" "${prof:-0}")
    fi
  done
fi
if has ncu; then
  step "ncu, decode attention"
  timeout 200 "$NCU" --clock-control none --profile-from-start off --nvtx --set full \
    --import-source no -o "$out/ncu" python3 bench/ncu_kernels.py --no-gemm \
    --fp8-launches w1n32s3 > "$out/ncu-run.log" 2>&1
  ncu_reports "$out/ncu.ncu-rep" "$out/ncu-" 3
  rm -f "$out/ncu.ncu-rep"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
    "$out/ncu-details.txt" | cut -c1-140 | head -40
fi
if has pool; then
  step "decode attention over blocks drawn from an engine-sized pool"
  timeout 200 python3 bench/time_decode_bt_ahead.py --out "$out/bt-ahead-pool.json" \
    --sizes 64x1152 128x2048 --pool-blocks 112000 \
    --launches w1n32s3 default+bt w1n16s3+bt w1n32s3x2+bt > "$out/bt-ahead-pool.log" 2>&1
  cut -c1-900 "$out/bt-ahead-pool.log" | grep -v "^$" | tail -4
fi
if has dmon; then
  step "engine both with nvidia-smi dmon (clocks, power) beside it"
  nvidia-smi dmon -s pcu -d 1 > "$out/dmon.txt" 2>&1 &
  dmon=$!
  engine_mode "$out" "both_dmon" "$2" 0
  kill $dmon
  tr -s ' ' < "$out/dmon.txt" | cut -c1-100 | paste -sd';' | cut -c1-5000
fi
if has tests; then
  step "decode attention and graph tests"
  timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_triton_kernels.py \
    tests/model/test_triton_fp8_kv.py tests/model/test_cuda_graph_path.py -k "decode or graph" \
    > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
round_pack
