#!/usr/bin/env bash
# Round 43's check that serving without a host tier costs what it did: bench_engine.py
# --serving-only (dummy llama3-8b, bf16, 640 x 1,024 in / 256 out, concurrency 64) at base
# (4362807's tpserve with this tree's bench scripts, unpacked in ab/base) and at this tree,
# one after the other on one machine.
# Prepare here: mkdir -p ab/base && git archive 4362807 tpserve | tar -x -C ab/base &&
#   mkdir -p ab/base/bench && cp bench/*.py ab/base/bench/;
#   then: bash bench/ab_r43.sh SHA   (carry ab and .whl; about 4 minutes)
source bench/gpu_env.sh
NEW=${1:?commit of this tree}
BASE=4362807610e8b3c1a6931021b91f3cf2dd77915d
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/ab-r43.txt") 2>&1
run() {  # run NAME SCRIPT SHA
  step "$1 ($3)"
  timeout 200 python3 "$2" --serving-only --git-commit "$3" --out "$OUT/serving-$1.json" \
    > "$OUT/serving-$1.log" 2>&1 || true
  grep -E "serving:" "$OUT/serving-$1.log" | cut -c1-300 || true
  tail -1 "$OUT/serving-$1.log" | cut -c1-300
}
run base ab/base/bench/bench_engine.py $BASE
run new bench/bench_engine.py "$NEW"
step done
