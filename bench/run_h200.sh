#!/usr/bin/env bash
# One device call: GPU tests of the kernels and graphs, then the engine benchmark.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_h200.sh OUT_DIR GIT_SHA [extra bench_engine flags...]
set -uo pipefail
out=$1 sha=$2; shift 2
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,utilization.gpu \
  --format=csv > "$out/nvidia-smi.csv"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_kernels.py \
  tests/model/test_cuda_graph_path.py 2>&1 | tail -4 | tee "$out/gpu-tests.txt"
timeout 300 python3 bench/bench_engine.py --out "$out/engine.json" --git-commit "$sha" "$@" \
  2>&1 | tee "$out/engine.log"
cp "$out/engine.profile.txt" "$out/engine-profile.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,utilization.gpu \
  --format=csv,noheader >> "$out/nvidia-smi.csv"
