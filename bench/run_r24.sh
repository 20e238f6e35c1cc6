#!/usr/bin/env bash
# One device call (planned for the next lease of an H200; none was lent on 2026-12-04):
# the session's new GPU paths measured for the first time.
#  1. the kernel tests of sliding windows and heads of 96, compiled on the GPU;
#  2. embeddings (--runner pooling) on the Qwen3-Embedding-0.6B / -8B shapes against
#     transformers' forward (bench_embeddings.py);
#  3. batch-1 decode and serving of the phi-3-mini (heads of 96 tiled as 128, a 2,047
#     window) and mistral-7b (a 4,096 window) dummy shapes (bench_engine.py);
#  4. embeddings over HTTP: tpserve serve --runner pooling + tpserve loadtest --endpoint
#     embeddings on the same workload as 2 (needs the tokenizer folder: here
#     `python bench/bench_http.py prepare --shape qwen3-0.6b`, then carry .benchdata).
#   bash bench/run_r24.sh SHA    (results under $OUT; carry [".whl", ".benchdata"])
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
step "kernel tests"
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/model/test_sliding_window.py \
  tests/model/test_triton_kernels.py -k "window or 96" 2>&1 | tail -3
step "embeddings qwen3-0.6b"
python3 bench/bench_embeddings.py --model qwen3-0.6b --git-commit "$SHA" \
  --out "$OUT/emb-qwen3-0.6b.json" | tail -30
step "embeddings qwen3-8b"
python3 bench/bench_embeddings.py --model qwen3-8b --num-prompts 1024 --git-commit "$SHA" \
  --out "$OUT/emb-qwen3-8b.json" | tail -30
for shape in phi-3-mini mistral-7b; do
  step "engine $shape"
  python3 bench/bench_engine.py --model "$shape" --serving-only --git-commit "$SHA" \
    --out "$OUT/engine-$shape.json" | tail -20
done
if [ -d .benchdata/qwen3-0.6b ]; then
  step "embeddings over HTTP qwen3-0.6b"
  python3 bench/bench_http.py run --out "$OUT/http-emb-qwen3-0.6b" --model .benchdata/qwen3-0.6b \
    --serve-flags "--load-format dummy --runner pooling --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 16384 --disable-log-requests" \
    --loadtest-flags "--endpoint embeddings --num-prompts 2048 --random-input-len 512 --max-concurrency 256 --num-warmups 64" \
    | tail -3
fi
step "done"
