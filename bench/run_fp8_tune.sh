#!/usr/bin/env bash
# One device call (~4 min) tuning issue 15's decode kernels: the fp8 kernel and fp8 KV tests
# compiled on the GPU while worker processes fill the Triton cache; then the graph-timed
# GEMM sweep of the one-row GEMV launches at M = 1, 2, 4 (bench/fp8_gemm.py --sweep
# --sweep-sets gemv, beside bf16 and the shipped launch), then decode attention over bf16
# vs fp8 caches with the fp8 launch sweep (bench/time_fp8_decode.py --sweep).
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_tune.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha TRITON_CACHE_DIR=/tmp/triton-cache-tune
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv,noheader
step "tests + parallel compile"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_kernels.py \
  tests/model/test_triton_fp8_kv.py > "$out/gpu-tests.txt" 2>&1 &
gemm=(--m 1 2 4 --sweep --sweep-sets gemv)
workers=12
for i in $(seq 0 $((workers - 1))); do
  timeout 120 python3 bench/fp8_gemm.py --compile-only "${gemm[@]}" --worker "$i/$workers" \
    > "/tmp/compile-$i.log" 2>&1 &
done
wait
grep -E "passed|failed|error" "$out/gpu-tests.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -20
cat /tmp/compile-*.log | grep -v "^$" | tail -3
step "GEMV sweep"
timeout 120 python3 bench/fp8_gemm.py "${gemm[@]}" --out "$out/fp8-gemv.json" --commit "$sha" \
  > "$out/fp8-gemv.log" 2>&1
python3 - "$out/fp8-gemv.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict) and "us" in v
               and k.startswith("wo["))
    print(r["shape"], r["m"], "bf16", r["bf16"]["us"], "shipped", r["weight_only"]["us"],
          "best", c[:3])
PY
step "decode attention sweep"
timeout 100 python3 bench/time_fp8_decode.py --sweep --out "$out/fp8-decode.json" \
  > "$out/fp8-decode.log" 2>&1
python3 - "$out/fp8-decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    c = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict))
    print(r["batch"], r["context"], "bf16", r["bf16_us"], "fp8", r["fp8_us"], "best", c[:3])
PY
step done
