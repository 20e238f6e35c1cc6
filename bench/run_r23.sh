#!/usr/bin/env bash
# Round 23 on the GPU machine: Qwen3 (q/k head RMSNorm fused into the RoPE + KV write
# kernel). PARTs (default "tests rope qwen3"):
#   tests   the GPU tests of the fused norm, the tiny Qwen3 on the Triton ops, and the
#           captured-graph path on a dummy Qwen3-0.6B
#   rope    bench/time_rope_head_norm.py: fused against unfused and RoPE alone
#   qwen3   bench_engine.py --serving-only on dummy qwen3-8b, bf16 then fp8 weights + KV
#   llama3  the same on dummy llama3-8b (the lease's reference)
#   bash bench/run_r23.sh OUT SHA [PART...]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests rope qwen3" "${@:3}"
if has tests; then
  step tests
  timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_head_norm.py tests/model/test_cuda_graph_path.py \
    "tests/model/test_triton_kernels.py::test_qwen3_head_norms_through_the_triton_ops" \
    > "$out/tests.log" 2>&1
  tail -5 "$out/tests.log"
fi
if has rope; then
  step rope
  timeout 200 python3 bench/time_rope_head_norm.py --out "$out/rope-head-norm.json" \
    > "$out/rope-head-norm.log" 2>&1
  cut -c1-300 "$out/rope-head-norm.log"
fi
for model in qwen3 llama3; do
  has $model || continue
  for mode in bf16 both; do
    flags=(); [ "$mode" = both ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
    step "engine $model-8b $mode"
    timeout 200 python3 bench/bench_engine.py --serving-only --model "$model-8b" "${flags[@]}" \
      --out "$out/engine-$model-$mode.json" --git-commit "$2" \
      > "$out/engine-$model-$mode.log" 2>&1
    grep -E "weights .* GiB|capacity|batch-1|serving:|GPU while" "$out/engine-$model-$mode.log" \
      | cut -c1-400
  done
done
step done
