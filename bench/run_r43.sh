#!/usr/bin/env bash
# Round 43's device call: the prefix cache's host tier (--kv-offloading-size), measured by
# bench/bench_offload.py in the engine (dummy llama3-8b, bf16, an 8 GiB device pool): 48
# documents of 4,096 tokens asked twice, 16 in flight, without a tier and with 40 GiB; the
# copies timed and checked bit for bit on the live pool first.
# Here: python bench/bench_http.py prepare (the model folder), then
#   bash bench/run_r43.sh SHA   (carry .whl and .benchdata; about 4 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r43.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
free -g | head -2
step "offload"
timeout 480 python3 bench/bench_offload.py --git-commit "$SHA" --out "$OUT/offload.json" \
  > "$OUT/offload.log" 2>&1 || echo "exit $?"
grep -E "copies|round|Error|error" "$OUT/offload.log" | cut -c1-600
tail -3 "$OUT/offload.log" | cut -c1-400
step done
