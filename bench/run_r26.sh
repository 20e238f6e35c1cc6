#!/usr/bin/env bash
# One device call (H200): mixtures of experts measured for the first time, then the Gemma
# plan of run_r25.sh, each step's results kept if a later one runs out of time.
#  1. the MoE tests on the GPU: the tiny Qwen3-MoE's prefill, mixed and decode steps
#     through captured CUDA graphs equal the eager forward and transformers' logits, in
#     bf16 and float32 (the Triton grouped product, offsets read on the device), and that
#     kernel (bf16, fp16, float32, fp8 experts) against torch._grouped_mm;
#  2. batch-1 decode and serving of the qwen3-30b-a3b dummy shape (128 experts, 8 per
#     token, 30.5B parameters, 3.3B active), bf16 and --quantization fp8
#     (bench_engine.py --serving-only);
#  3. the grouped products, torch._grouped_mm against the Triton kernel (and its fp8
#     experts), per expert layer of Qwen3-30B-A3B and Mixtral-8x7B at 1 to 8,192 tokens
#     (time_moe.py);
#  4. run_r25.sh's Gemma kernel tests and gemma-2-9b / gemma-3-12b engine runs.
#   bash bench/run_r26.sh SHA    (results under $OUT; carry [".whl"])
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
step "moe tests"
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_moe.py \
  tests/parallel/test_moe_experts.py tests/model/test_triton_moe.py 2>&1 | tail -15
for quant in none fp8; do
  step "engine qwen3-30b-a3b $quant"
  python3 bench/bench_engine.py --model qwen3-30b-a3b --serving-only --quantization "$quant" \
    --git-commit "$SHA" --out "$OUT/engine-qwen3-30b-a3b-$quant.json" 2>&1 | tail -22
done
step "grouped products"
python3 bench/time_moe.py --out "$OUT/moe.json" 2>&1 | tail -15
step "gemma (run_r25.sh)"
bash bench/run_r25.sh "$SHA" 2>&1 | tail -50
step "done"
