#!/usr/bin/env bash
# Round 45: the host tier's inter-token latency with staggered requests (bench_offload.py
# --stagger: output lengths 16..48, so requests finish and are replaced one by one while
# others decode, as on a server), without a tier and with 40 GiB; the step calls' times by
# the copies listed in them say whether stores or loads make the tail.
#   bash bench/run_r45.sh SHA   (carry .whl and .benchdata; about 3 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r45.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
step "offload (engine, staggered)"
offload_stagger offload_stagger "$SHA" 0,40
step done
