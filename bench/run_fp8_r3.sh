#!/usr/bin/env bash
# One device call (~8 min): issue 15 round 3 on the H200. The new kernels' tests compiled
# (Triton W8A8 GEMM, quantization fused into the norms and the gate, the fp8 decode
# launches); the W8A8 launch sweep of bench/fp8_gemm.py (compiled first by 12 processes);
# the serving workload with --profile-serving for fp8 weights + fp8 KV; the fp8 decode
# attention sweep with split factors.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_r3.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
t0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
ms=(32 64 128 256 512)
step "compile the w8a8 sweep"
for i in $(seq 0 11); do
  timeout 150 python3 bench/fp8_gemm.py --compile-only --worker "$i/12" --sweep \
    --sweep-sets w8a8 --m "${ms[@]}" > /dev/null 2>&1 &
done
step "tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_w8a8.py \
  tests/model/test_fp8_fused.py "tests/model/test_triton_fp8_kv.py::test_decode_attention_over_fp8" \
  > "$out/gpu-tests.txt" 2>&1
grep -E "passed|failed" "$out/gpu-tests.txt" | tail -1
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -10
wait
step "w8a8 sweep"
timeout 150 python3 bench/fp8_gemm.py --sweep --sweep-sets w8a8 --m "${ms[@]}" \
  --out "$out/gemm.json" --commit "$sha" > "$out/gemm.log" 2>&1
tail -25 "$out/gemm.log" | cut -c1-200
step "engine both"
timeout 200 python3 bench/bench_engine.py --serving-only --profile-serving 400 \
  --out "$out/engine-both.json" --git-commit "$sha" --quantization fp8 --kv-cache-dtype fp8 \
  > "$out/engine-both.log" 2>&1
grep -E "batch-1|serving:|serving profile" "$out/engine-both.log" | cut -c1-1200
step "decode sweep"
timeout 100 python3 bench/time_fp8_decode.py --sweep --split-factors 2 4 \
  --sizes 64:1152,128:2048 --out "$out/decode.json" > "$out/decode.log" 2>&1
python3 - "$out/decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    best = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict) and "us" in v)[:4]
    print(r["batch"], r["context"], "bf16", r["bf16_us"], "fp8", r["fp8_us"], best)
PY
step done
