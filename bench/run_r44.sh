#!/usr/bin/env bash
# Round 44's device call: the host tier's loads on a copy stream beside a step (this tree)
# against loads that the step waits for.
#  1. tests/model/test_kv_offload.py on the GPU (the copy stream's waits, held up by a spin).
#  2. bench_offload.py in the engine (as round 43: dummy llama3-8b bf16, 8 GiB pool, 48
#     documents of 4,096 tokens asked twice, 16 in flight): 40 GiB with the step
#     waiting for its loads ("40sync"), 40 GiB beside; tokens compared with the first run.
#  3. Over HTTP, round 43's prefix-repetition load test with a 40 GiB tier: base (7463c34's
#     tpserve, loads on the forward's stream, unpacked in ab/base) and this tree.
# It ran at c4520a6. The copy stream and bench_offload's "sync" sizes were reverted in
# 4b6b0a0, so it runs only at that commit (git worktree add ../r44 c4520a6).
# Prepare here: python bench/bench_http.py prepare; rm -rf ab/base && mkdir -p ab/base &&
#   git archive 7463c34 tpserve | tar -x -C ab/base; then
#   bash bench/run_r44.sh SHA   (carry .whl, .benchdata and ab; about 6 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r44.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
step "GPU tests"
timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider --tb=short \
  tests/model/test_kv_offload.py 2>&1 | tail -15
step "offload (engine)"
timeout 240 python3 bench/bench_offload.py --offload 40sync,40 --git-commit "$SHA" \
  --out "$OUT/offload.json" > "$OUT/offload.log" 2>&1 || echo "exit $?"
grep -E "copies|round|vs the first|Error|error" "$OUT/offload.log" | cut -c1-700
SERVE="--load-format dummy --dtype bfloat16 --max-model-len 4352 --max-num-seqs 16
  --max-num-batched-tokens 8192 --kv-cache-memory 8GiB --log-level info --kv-offloading-size 40"
LOAD="--dataset-name prefix-repetition --prefix-repetition-prefix-len 4096
  --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 48 --num-prompts 192
  --random-output-len 32 --ignore-eos --max-concurrency 16 --seed 0 --no-progress --no-plot"
for tree in base new; do
  step "HTTP, tier 40 GiB, $tree"
  root=$PWD; [ "$tree" = base ] && root=$PWD/ab/base
  PYTHONPATH=/tmp/site:$root timeout 200 python3 bench/bench_http.py run \
    --out "$OUT/http-$tree" --deadline-s 190 --startup-timeout-s 150 --serve-flags "$SERVE" \
    --loadtest-flags "$LOAD" > "$OUT/http-$tree.log" 2>&1 || echo "exit $?"
  tail -3 "$OUT/http-$tree.log" | cut -c1-300
  grep -E "KV offloading|host tier" "$OUT/http-$tree/server.log" | tail -2 | cut -c1-300
  python3 - "$OUT/http-$tree/http.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("completed", "failed", "duration", "output_throughput",
      "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
      "median_itl_ms", "p99_itl_ms", "mean_tpot_ms")})
PY
done
step done
