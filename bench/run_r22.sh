#!/usr/bin/env bash
# Round 22 on the GPU machine: does this session's engine work (the priority-capable
# scheduler's rank bookkeeping, the gated grammar, reasoning and Responses plumbing) cost
# serving anything? Serving at concurrency C (default 64; 10 x C prompts) in each MODE
# (default "both bf16": fp8 weights + KV, then bf16), AB_ROUNDS rounds (default 2)
# alternating this tree and a copy with .whl/r22.patch reversed (carry it:
# `git diff BASE HEAD -- tpserve > .whl/r22.patch`).
#   bash bench/run_r22.sh OUT SHA
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "ab" "${@:3}"
base=/tmp/r22-base
rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r22.patch) || exit 1
c=${C:-64}
for mode in ${MODES:-both bf16}; do
  flags=(); [ "$mode" = both ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
  for ((i = 1; i <= ${AB_ROUNDS:-2}; i++)); do
    for spec in "new:." "base:$base"; do
      name=${spec%%:*} tree=${spec#*:}
      step "serving $mode c=$c $name-$i"
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/bench_engine.py \
        --serving-only "${flags[@]}" --concurrency "$c" --num-prompts $((10 * c)) \
        --out "$out/engine-$mode-c$c-$name-$i.json" --git-commit "$2-$name" \
        > "$out/engine-$mode-c$c-$name-$i.log" 2>&1)
      grep -E "batch-1|serving:|GPU while" "$out/engine-$mode-c$c-$name-$i.log" | cut -c1-400
    done
  done
done
step done
