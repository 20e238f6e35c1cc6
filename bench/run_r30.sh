#!/usr/bin/env bash
# One device call (planned for the next lease of an H100/H200; none was lent on
# 2026-12-05): GPTQ / AWQ / compressed-tensors integer weights measured for the first time.
#  1. the WNA16 kernel tests compiled on the GPU (bf16 / fp16 / fp32, 4 and 8 bits,
#     act-order, split K) and the tiny Llama's GPTQ / AWQ / pack-quantized steps through
#     captured CUDA graphs against eager and the dequantized twin;
#  2. a random GPTQ checkpoint of llama3-8b (4-bit, groups of 128; bench/make_int_checkpoint.py,
#     about 5.7 GB on the device's disk);
#  3. the kernel against fp16 cuBLAS per llama3-8b layer shape, M = 1 .. 2,048, 4 and 8
#     bits, with act-order too (time_wna16.py), then a sweep of its launch (4-bit);
#  4. batch-1 decode and serving (bench_engine.py --serving-only): the fp16 dummy, then the
#     GPTQ checkpoint in fp16, in the same lease.
#   bash bench/run_r30.sh SHA    (results under $OUT; carry [".whl"])
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
step "wna16 tests"
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_triton_wna16.py \
  tests/model/test_int_checkpoint.py 2>&1 | tail -15 || true
step "gptq checkpoint llama3-8b"
python3 bench/make_int_checkpoint.py --shape llama3-8b --format gptq --bits 4 \
  --group-size 128 --out /tmp/llama3-8b-gptq 2>&1 | tail -3
step "kernel against cuBLAS"
python3 bench/time_wna16.py --git-commit "$SHA" --act-order --out "$OUT/wna16.json" 2>&1 \
  | tail -40 || true
step "kernel launch sweep (4-bit, decode to mid sizes)"
python3 bench/time_wna16.py --git-commit "$SHA" --sweep --bits 4 --m 1 4 16 64 256 \
  --out "$OUT/wna16-sweep.json" 2>&1 | tail -40 || true
step "engine llama3-8b fp16"
python3 bench/bench_engine.py --model llama3-8b --dtype float16 --serving-only \
  --git-commit "$SHA" --out "$OUT/engine-llama3-8b-fp16.json" 2>&1 | tail -20
step "engine llama3-8b gptq"
python3 bench/bench_engine.py --model /tmp/llama3-8b-gptq --load-format safetensors \
  --dtype float16 --quantization auto --serving-only --git-commit "$SHA" \
  --out "$OUT/engine-llama3-8b-gptq.json" 2>&1 | tail -20
step "done"
