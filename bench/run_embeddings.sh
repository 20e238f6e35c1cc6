#!/usr/bin/env bash
# One device call: bench/bench_embeddings.py on the Qwen3-Embedding-0.6B and -8B shapes
# (dummy qwen3-0.6b / qwen3-8b: the embedding models share their LMs' shapes), each with
# the Triton-vs-torch agreement check and transformers' forward as the baseline.
#   bash bench/run_embeddings.sh SHA    (results under $OUT)
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
step "qwen3-0.6b"
python3 bench/bench_embeddings.py --model qwen3-0.6b --git-commit "$SHA" \
  --out "$OUT/emb-qwen3-0.6b.json" | tail -40
step "qwen3-8b"
python3 bench/bench_embeddings.py --model qwen3-8b --num-prompts 1024 --git-commit "$SHA" \
  --out "$OUT/emb-qwen3-8b.json" | tail -40
step "done"
