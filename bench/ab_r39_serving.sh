#!/usr/bin/env bash
# Round 39's serving A/B (one device call): bench_engine.py --serving-only (dummy llama3-8b,
# bf16) at a4885ce (round 38's head, from ab/base) and at this tree, alternating.
# Prepare ab/base (git-ignored, carried as "ab"): mkdir -p ab/base && git archive a4885ce
#   tpserve $(git ls-tree --name-only a4885ce bench/ | grep "\.py$") | tar -x -C ab/base; then: bash bench/ab_r39_serving.sh SHA
source bench/gpu_env.sh
NEW=${1:?commit of this tree}
serving_ab a4885ce3d883eaf80ac77afe44b980685445eb7e "$NEW"
step done
