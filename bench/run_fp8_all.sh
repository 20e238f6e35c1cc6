#!/usr/bin/env bash
# One device call (~8 min) for issue 15 in one lease: the fp8 kernel, fp8 KV and graph tests
# compiled on the GPU; bench_engine.py --serving-only (batch-1 decode and the serving
# workload: 640 x 1024 in / 256 out, c=64) with bf16, fp8 weights, an fp8 KV cache and
# both; then fp8_accuracy.py on dummy llama3-8b (all four modes); then, if time is left,
# decode attention over bf16 vs fp8 caches. Each step has its own timeout.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8_all.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
export TPSERVE_GIT_COMMIT=$sha
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$out/nvidia-smi.csv"
step "GPU tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_kernels.py \
  tests/model/test_triton_fp8_kv.py tests/model/test_cuda_graph_path.py \
  tests/model/test_triton_kernels.py > "$out/gpu-tests.txt" 2>&1
grep -E "passed|failed" "$out/gpu-tests.txt" | tail -1
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.txt" | head -10
for mode in bf16 fp8w fp8kv both; do
  case $mode in
    bf16) flags=() ;;
    fp8w) flags=(--quantization fp8) ;;
    fp8kv) flags=(--kv-cache-dtype fp8) ;;
    both) flags=(--quantization fp8 --kv-cache-dtype fp8) ;;
  esac
  step "engine $mode"
  timeout 110 python3 bench/bench_engine.py --serving-only --out "$out/engine-$mode.json" \
    --git-commit "$sha" "${flags[@]}" > "$out/engine-$mode.log" 2>&1
  grep -E "weights .* GiB|capacity|batch-1|serving:" "$out/engine-$mode.log" | cut -c1-220
done
step "accuracy, dummy llama3-8b"
timeout 100 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
  --max-prompt-len 2000 --decode-tokens 16 --git-commit "$sha" --out "$out/fp8-accuracy.json" \
  > "$out/fp8-accuracy.log" 2>&1; tail -4 "$out/fp8-accuracy.log" | cut -c1-400
step "decode attention bf16 vs fp8 cache"
timeout 45 python3 bench/time_fp8_decode.py --out "$out/fp8-decode.json" > "$out/fp8-decode.log" 2>&1
tail -8 "$out/fp8-decode.log"
step done
