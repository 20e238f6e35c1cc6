#!/usr/bin/env bash
# Round 40's device call after the scheduler stopped decoding a pending last token: the
# serving A/B of bench_engine.py --serving-only (dummy llama3-8b, bf16) at 00316ff (the
# session's start, from ab/base) and at this tree, then beam search on dummy llama3-8b
# (bench/beam_search.py, with the engine's steps per request).
# Prepare ab/base (git-ignored, carried as "ab"): mkdir -p ab/base && git archive 00316ff
#   tpserve $(git ls-tree --name-only 00316ff bench/ | grep "\.py$") | tar -x -C ab/base;
#   then: bash bench/ab_r40.sh SHA   (carry ab and .whl; about 5 minutes)
source bench/gpu_env.sh
NEW=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/ab-r40.txt") 2>&1  # the output comes back whole
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
# part beam: the beam search alone
[ "${2:-all}" = beam ] || serving_ab 00316ffc324375897395dfff3e89545291855e79 "$NEW"
step "dummy llama3-8b bf16: greedy and beams, the engine's steps per request"
timeout 200 python3 bench/beam_search.py --model llama3-8b --dtype bfloat16 \
  --serve-flags "--load-format dummy --max-model-len 2048" --widths 1 4 8 --git-commit "$NEW" \
  --out "$OUT/beam-llama3-8b-bf16.json" 2>&1 | grep -v -i "warn" || true
step done
