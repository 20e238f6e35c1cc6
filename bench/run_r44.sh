#!/usr/bin/env bash
# Round 44's device call: the host tier's loads on a copy stream beside the step before
# (this tree) against loads on the forward's stream in the step that reads them.
# 1. bench_offload.py in the engine (round 43's workload): no tier, 40 GiB with loads on
#    the forward's stream ("40sync"), 40 GiB with loads beside the step before; the last
#    round's tokens compared with the run without a tier.
# 2. Over HTTP (round 43's prefix-repetition load test), a 40 GiB tier at base (d3d4d9c's
#    tpserve, unpacked in ab/base) and at this tree, one after the other.
# Prepare here: python bench/bench_http.py prepare; mkdir -p ab/base && git archive
#   d3d4d9c tpserve | tar -x -C ab/base && mkdir -p ab/base/bench && cp bench/*.py
#   ab/base/bench/; then: bash bench/run_r44.sh SHA  (carry .whl, .benchdata, ab; ~5 min)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r44.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total --format=csv,noheader
step "engine"
timeout 240 python3 bench/bench_offload.py --offload 0,40sync,40 --git-commit "$SHA" \
  --out "$OUT/offload.json" > "$OUT/offload.log" 2>&1 || echo "exit $?"
grep -E "copies|round 1|vs the|Error" "$OUT/offload.log" | cut -c1-420
SERVE="--load-format dummy --dtype bfloat16 --max-model-len 4352 --max-num-seqs 16
  --max-num-batched-tokens 8192 --kv-cache-memory 8GiB --log-level info --kv-offloading-size 40"
LOAD="--dataset-name prefix-repetition --prefix-repetition-prefix-len 4096
  --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 48 --num-prompts 192
  --random-output-len 32 --ignore-eos --max-concurrency 16 --seed 0 --no-progress --no-plot"
http() {  # http NAME ROOT
  step "http $1"
  PYTHONPATH=/tmp/site:$PWD/$2 timeout 200 python3 $2/bench/bench_http.py run \
    --out "$OUT/http-$1" --deadline-s 190 --startup-timeout-s 150 --serve-flags "$SERVE" \
    --loadtest-flags "$LOAD" > "$OUT/http-$1.log" 2>&1 || echo "exit $?"
  python3 - "$OUT/http-$1/http.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
r.pop("itls", None)
json.dump(r, open(sys.argv[1], "w"), indent=1)
print({k: r.get(k) for k in ("completed", "failed", "duration", "total_token_throughput",
      "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms")})
PY
}
http base ab/base
http new .
step done
