#!/usr/bin/env bash
# Round 7 on the H200 (issue 15's serving target): programmatic dependent launch of the
# Triton kernels (--pdl, kernels/triton_pdl.py), one device call per invocation:
#   tests: the PDL tests (bit-identical logits with and without, captured and eager, bf16
#     and fp8) with the CUDA-graph, fp8-kernel and W8A8 tests, compiled on the GPU;
#   ab: bench_engine.py --serving-only for fp8 weights + KV and bf16, each with PDL (the
#     default) and --no-pdl, in one lease;
#   final: fp8 KV and fp8 weights alone (with PDL), for the full bf16 / fp8 table;
#   profile: fp8 weights + KV with 400 profiled serving steps.
# Usage (GPU machine, repo root, .whl carried; everything packed into OUT_DIR.tgz):
#   bash bench/run_r7.sh OUT_DIR GIT_SHA [tests] [ab] [final] [profile]
set -uo pipefail
out=$1 sha=$2
shift 2
parts=("${@:-tests ab}")
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
export TPSERVE_GIT_COMMIT=$sha
has() { [[ " ${parts[*]} " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$out/nvidia-smi.csv"
if has tests; then
  step "tests"
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_pdl.py \
    tests/model/test_cuda_graph_path.py tests/model/test_triton_w8a8.py \
    tests/model/test_fp8_fused.py > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has ab; then
  for mode in both both-nopdl bf16 bf16-nopdl; do
    step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0
  done
fi
if has final; then
  for mode in fp8kv fp8w; do step "engine $mode"; engine_mode "$out" "$mode" "$sha" 0; done
fi
if has profile; then
  mkdir -p "$out/prof"
  step "engine both, profiled"; engine_mode "$out/prof" both "$sha" 400
fi
step done
tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && rm -rf "$out"
