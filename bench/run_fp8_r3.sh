#!/usr/bin/env bash
# Issue 15 round 3 on the H200, one device call per PART:
#   sweep: the new kernels' tests compiled (Triton W8A8 GEMM, quantization fused into the
#     norms and the gate, the fp8 decode launches); the W8A8 launch sweep of
#     bench/fp8_gemm.py (compiled first by 12 processes); the serving workload with
#     --profile-serving for fp8 weights + fp8 KV; the fp8 decode attention sweep with split
#     factors (~5 min);
#   final: the GPU tests of the fp8 paths and the graphs; bench_engine.py --serving-only
#     --profile-serving for fp8 weights + KV, fp8 weights, bf16 and the fp8 KV cache (one
#     lease); the W8A8 table's GEMMs against cuBLAS (~9 min). Everything is packed into
#     OUT_DIR/r3-final.tgz (a call brings back at most 8 files).
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_r3.sh OUT_DIR GIT_SHA sweep|final [MODE...]
# (final's MODEs: default both fp8w bf16 fp8kv; naming some also skips the GEMM table)
set -uo pipefail
out=$1 sha=$2 part=$3
shift 3
modes=("$@")
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
engine() { step "engine $1"; engine_mode "$res" "$1" "$sha"; }
tests() {  # FILE...: compiled on the GPU
  step "tests"
  timeout 200 python3 -m pytest -q -p no:cacheprovider "$@" > "$res/gpu-tests.txt" 2>&1
  grep -E "passed|failed" "$res/gpu-tests.txt" | tail -1
  grep -E "^(FAILED|ERROR)" "$res/gpu-tests.txt" | head -10
}
if [ "$part" = sweep ]; then
  res=$out
  ms=(32 64 128 256 512)
  step "compile the w8a8 sweep"
  for i in $(seq 0 11); do
    timeout 150 python3 bench/fp8_gemm.py --compile-only --worker "$i/12" --sweep \
      --sweep-sets w8a8 --m "${ms[@]}" > /dev/null 2>&1 &
  done
  tests tests/model/test_triton_w8a8.py tests/model/test_fp8_fused.py \
    "tests/model/test_triton_fp8_kv.py::test_decode_attention_over_fp8"
  wait
  step "w8a8 sweep"
  timeout 150 python3 bench/fp8_gemm.py --sweep --sweep-sets w8a8 --m "${ms[@]}" \
    --out "$out/gemm.json" --commit "$sha" > "$out/gemm.log" 2>&1
  tail -25 "$out/gemm.log" | cut -c1-200
  engine both
  step "decode sweep"
  timeout 100 python3 bench/time_fp8_decode.py --sweep --split-factors 2 4 \
    --sizes 64:1152,128:2048 --out "$out/decode.json" > "$out/decode.log" 2>&1
  python3 - "$out/decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    best = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict) and "us" in v)[:4]
    print(r["batch"], r["context"], "bf16", r["bf16_us"], "fp8", r["fp8_us"], best)
PY
elif [ "$part" = final ]; then
  res=$out/r3-final
  mkdir -p "$res"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
    --format=csv > "$res/nvidia-smi.csv"
  tests tests/model/test_triton_w8a8.py tests/model/test_fp8_fused.py \
    tests/model/test_cuda_graph_path.py \
    "tests/model/test_fp8_kernels.py::test_fp8_method_chooses_by_static_m_and_matches_its_reference"
  for mode in "${modes[@]:-both fp8w bf16 fp8kv}"; do
    for m in $mode; do engine "$m"; done
  done
  if [ ${#modes[@]} -eq 0 ]; then
    step "w8a8 table against cuBLAS"
    timeout 60 python3 bench/fp8_gemm.py --m 64 128 256 512 --out "$res/gemm.json" \
      --commit "$sha" > "$res/gemm.log" 2>&1
    tail -22 "$res/gemm.log" | cut -c1-200
  fi
  tar czf "$out/r3-final.tgz" -C "$out" r3-final && rm -rf "$res"
fi
step done
