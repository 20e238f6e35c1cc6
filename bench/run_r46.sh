#!/usr/bin/env bash
# Round 46: round 45's staggered host-tier run again, with the tier's loads on a copy
# stream beside the steps (a sequence waits for its own loads while the others decode);
# then the GPU tests of the copy stream and of the engine over it.
# Then the same run at the commit before (2fed6f6, its tpserve and bench scripts under
# ab/base, git-ignored) on the same machine, the baseline.
#   bash bench/run_r46.sh SHA   (carry .whl, .benchdata and ab; about 5 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out} OFFLOAD_TIMEOUT=200
mkdir -p "$OUT" && exec > >(tee "$OUT/r46.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
step "offload (engine, staggered)"
offload_stagger offload_stagger "$SHA" 0,40
step "GPU tests: the copy stream, the engine over it"
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_kv_offload.py tests/server/engine/test_kv_offload_engine.py -k "cuda" 2>&1 \
  | tail -15 || true
if [ -d ab/base ]; then
  step "baseline: 2fed6f6, loads on the forward's stream"
  offload_stagger offload_stagger_base 2fed6f6 40 ab/base
fi
step done
