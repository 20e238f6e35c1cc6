#!/usr/bin/env bash
# One device call (under 200 s) for the fp8 kernels: the kernel tests compiled on the GPU
# while worker processes fill the Triton cache with every launch of the sweep, then the
# CUDA-graph-timed GEMM sweep (bench/fp8_gemm.py --sweep) alone on the GPU. A compact
# table goes to stdout; gpu-tests.txt, fp8-gemm.log and fp8-gemm.json to OUT_DIR.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_kernels.sh OUT_DIR GIT_SHA [extra fp8_gemm.py flags...]
set -uo pipefail
out=$1 sha=$2; shift 2
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha TRITON_CACHE_DIR=/tmp/triton-cache-fp8
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv,noheader
echo "=== tests + parallel compile ($(date +%T))"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_kernels.py \
  > "$out/gpu-tests.txt" 2>&1 &
workers=10
for i in $(seq 0 $((workers - 1))); do
  timeout 100 python3 bench/fp8_gemm.py --compile-only --sweep --worker "$i/$workers" "$@" \
    > "/tmp/compile-$i.log" 2>&1 &
done
wait
grep -E "passed|failed|error" "$out/gpu-tests.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -20
cat /tmp/compile-*.log | tail -5
echo "=== graph-timed sweep ($(date +%T), $(( $(date +%s) - t0 )) s in)"
timeout 100 python3 bench/fp8_gemm.py --sweep --out "$out/fp8-gemm.json" --commit "$sha" "$@" \
  > "$out/fp8-gemm.log" 2>&1
grep -v '^{' "$out/fp8-gemm.log" | tail -80
echo "=== done ($(( $(date +%s) - t0 )) s)"
