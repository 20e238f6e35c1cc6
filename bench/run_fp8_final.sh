#!/usr/bin/env bash
# Issue 15's measurement in three device calls of one lease (~5 min each): PART "a" runs
# bench_engine.py --serving-only --profile (batch-1 decode, the serving workload 640 x 1024
# in / 256 out at c = 64, per-kernel profiles of batch-1 and mixed steps) with bf16 and
# --quantization fp8; PART "b" the same with --kv-cache-dtype fp8 and with both, then
# decode attention over bf16 vs fp8 caches; PART "tests" the fp8 kernel, fp8 KV, Triton
# and graph tests compiled on the GPU. Each step has its own timeout.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_final.sh OUT_DIR GIT_SHA a|b|tests
set -uo pipefail
out=$1 sha=$2 part=$3
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$out/nvidia-smi-$part.csv"
engine() {  # MODE
  local mode=$1 flags=()
  case $mode in
    fp8w) flags=(--quantization fp8) ;;
    fp8kv) flags=(--kv-cache-dtype fp8) ;;
    both) flags=(--quantization fp8 --kv-cache-dtype fp8) ;;
  esac
  step "engine $mode"
  timeout 170 python3 bench/bench_engine.py --serving-only --profile \
    --out "$out/engine-$mode.json" --git-commit "$sha" "${flags[@]}" \
    > "$out/engine-$mode.log" 2>&1
  grep -E "weights .* GiB|capacity|batch-1|serving:" "$out/engine-$mode.log" | cut -c1-220
}
if [ "$part" = tests ]; then
  step "GPU tests"
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_kernels.py \
    tests/model/test_triton_fp8_kv.py tests/model/test_cuda_graph_path.py \
    tests/model/test_triton_kernels.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed" "$out/gpu-tests.txt" | tail -1
  grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -10
elif [ "$part" = a ]; then
  engine bf16
  engine fp8w
else
  engine fp8kv
  engine both
  step "decode attention bf16 vs fp8 cache"
  timeout 45 python3 bench/time_fp8_decode.py --out "$out/fp8-decode.json" \
    > "$out/fp8-decode.log" 2>&1
  tail -6 "$out/fp8-decode.log" | cut -c1-200
fi
step done
