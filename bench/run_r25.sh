#!/usr/bin/env bash
# One device call (planned for the next lease of an H200; none was lent on 2026-12-04/05):
# Gemma's GPU paths measured for the first time.
#  1. the Gemma kernel tests compiled on the GPU: the attention softcap in both attention
#     kernels (heads of 64, 128 and 256, FP8 cache), unit-offset norms and q/k head norms,
#     the GeLU-tanh gate, tiny Gemma 2/3 through the Triton ops against the torch reference,
#     and SmolLM3's NoPE layers (the RoPE kernel reading a one-row table at stride 0);
#  2. batch-1 decode and serving of the gemma-2-9b (softcaps, heads of 256, every other
#     layer windowed at 4,096) and gemma-3-12b (q/k head norms, two RoPE tables, five in
#     six layers windowed at 1,024) dummy shapes (bench_engine.py): the first figures for
#     heads of 256, whose prefill launch (8 warps: bench/README.md) was chosen offline.
#   bash bench/run_r25.sh SHA    (results under $OUT; carry [".whl"])
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
step "kernel tests"
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_softcap.py \
  tests/model/test_triton_head_norm.py tests/model/test_triton_kernels.py \
  -k "softcap or unit_offset or gelu or gemma or head_norm or smollm3" 2>&1 | tail -3
for shape in gemma-2-9b gemma-3-12b; do
  step "engine $shape"
  python3 bench/bench_engine.py --model "$shape" --git-commit "$SHA" \
    --out "$OUT/engine-$shape.json" | tail -20
done
step "done"
