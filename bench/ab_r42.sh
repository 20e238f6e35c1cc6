#!/usr/bin/env bash
# Round 42's device call, after log-probability entries began to keep each token's text
# (engine/token_texts.TokenTexts): bench_engine.py --serving-only (dummy llama3-8b, bf16,
# 640 x 1,024 in / 256 out, concurrency 64) with --logprobs 20 at base (cb12828's tpserve
# with this tree's bench scripts, unpacked in ab/base) and at this tree, then this tree
# without log-probabilities, one after the other on one machine.
# Prepare here: mkdir -p ab/base && git archive cb12828 tpserve | tar -x -C ab/base &&
#   mkdir -p ab/base/bench && cp bench/*.py ab/base/bench/;
#   then: bash bench/ab_r42.sh SHA   (carry ab and .whl; about 5 minutes)
source bench/gpu_env.sh
NEW=${1:?commit of this tree}
BASE=cb12828f3fd3abe99aaa5b20ef52d25a6cd8c4d9
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/ab-r42.txt") 2>&1  # the output comes back whole
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
run() {  # run NAME SCRIPT SHA FLAGS...
  local name=$1 script=$2 sha=$3
  shift 3
  step "$name ($sha)"
  timeout 200 python3 "$script" --serving-only --git-commit "$sha" --out "$OUT/serving-$name.json" \
    "$@" > "$OUT/serving-$name.log" 2>&1 || true
  grep -E "batch-1|serving:" "$OUT/serving-$name.log" | cut -c1-300 || true
  tail -1 "$OUT/serving-$name.log" | cut -c1-300
}
run base-logprobs20 ab/base/bench/bench_engine.py $BASE --logprobs 20
run new-logprobs20 bench/bench_engine.py "$NEW" --logprobs 20
run new bench/bench_engine.py "$NEW"
step done
