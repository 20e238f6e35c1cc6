#!/usr/bin/env bash
# Round 16 (issue 15) on the GPU machine: the Triton W8A8 kernel with fast accumulation
# (each program's K chunk summed in the fp8 tensor cores, as --fp8-fast-accum has cuBLAS do)
# and the lazy running maximum in fp8 decode attention, measured in joules per output token
# as well as tok/s (bench/gpu_power.py). Carry .whl.
#   bash bench/run_r16.sh OUT SHA [PART...]   parts: gemm ab table tests (default: gemm ab)
# gemm: fp8_gemm.py at M = 64 on the four Llama-3-8B shapes, the W8A8 launches promoted and
# fast; ab: fp8 weights + KV serving twice each, alternating this tree ("fast"), a copy whose
# W8A8 kernel promotes ("promoted": the tree before), and a copy with lazy_rescale in
# FP8_LAUNCH ("lazy"); table: serving twice each, this tree and a copy whose
# fast-accumulation W8A8 launches are the promoted table's 128 x 128 K steps; tests: the
# W8A8, decode-attention and CUDA-graph tests compiled on the GPU. The heads-as-columns
# parts (decode, cols) ran in this script at 2801b2e and left with heads_as_cols.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "gemm ab" "${@:3}"
if has gemm; then
  step "W8A8 at M = 64, promoted and fast"
  timeout 200 python3 bench/fp8_gemm.py --m 64 --sweep --sweep-sets w8a8 \
    --out "$out/fp8-gemm.json" --commit "$2" > "$out/fp8-gemm.log" 2>&1
  python3 - "$out/fp8-gemm.json" <<'PY'
import json, sys
tot = {}
for r in json.load(open(sys.argv[1]))["rows"]:
    cells = {k: v["us"] for k, v in r.items() if isinstance(v, dict) and "us" in v}
    best = {f: min((us, k) for k, us in cells.items() if k.startswith(f + "[")) for f in ("w8a8", "w8a8_fast")}
    print(r["shape"], r["m"], "table", cells.get("w8a8"), "fast", cells.get("w8a8_fast"),
          "bf16", cells.get("bf16"), "| best", best)
    for k in ("w8a8", "w8a8_fast"):
        tot[k] = tot.get(k, 0) + cells.get(k, 0)
print("layer sum (us):", {k: round(v, 2) for k, v in tot.items()})
PY
  tail -2 "$out/fp8-gemm.log" | cut -c1-300
fi
if has ab; then
  promoted=/tmp/r16-promoted lazy=/tmp/r16-lazy
  rm -rf "$promoted" "$lazy" && cp -r . "$promoted" && cp -r . "$lazy"
  sed -i 's/FAST=fast_accum,/FAST=False,/' "$promoted/tpserve/model/kernels/triton_w8a8.py"
  sed -i 's/^FP8_LAUNCH = DecodeLaunch(16, 1, 4, True, scale_v=True, target_programs=1024, bt_ahead=True)$/FP8_LAUNCH = DecodeLaunch(16, 1, 4, True, scale_v=True, target_programs=1024, bt_ahead=True, lazy_rescale=True)/' \
    "$lazy/tpserve/model/kernels/triton_decode_attention.py"
  grep -n "FAST=" "$promoted/tpserve/model/kernels/triton_w8a8.py"
  grep -n "^FP8_LAUNCH" "$lazy/tpserve/model/kernels/triton_decode_attention.py"
  alternate "$out" 2 "fast:.:$2" "promoted:$promoted:$2+w8a8-promoted" \
    "lazy:$lazy:$2+lazy-rescale"
fi
if has table; then
  # the fast-accumulation W8A8 table (w8a8_blocks) against the 128 x 128 steps it replaces
  old=/tmp/r16-table
  rm -rf "$old" && cp -r . "$old"
  sed -i 's/^    if not fast_accum or n >= 16384:$/    if True:  # round 16 A\/B: the table before/' \
    "$old/tpserve/model/kernels/triton_w8a8.py"
  grep -n "if True:  # round 16" "$old/tpserve/model/kernels/triton_w8a8.py" || exit 1
  alternate "$out" 2 "table:.:$2" "before:$old:$2+w8a8-128x128-steps"
fi
if has tests; then
  step "W8A8 and decode-attention tests"
  timeout 280 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_triton_w8a8.py \
    tests/model/test_triton_fp8_kv.py tests/model/test_triton_kernels.py tests/model/test_cuda_graph_path.py \
    -k "w8a8 or decode or fast or graph" > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
round_pack
