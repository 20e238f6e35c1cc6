#!/usr/bin/env bash
# Round 43, over HTTP: tpserve serve (dummy llama3-8b, bf16, an 8 GiB device pool) without
# and with a 40 GiB host tier (--kv-offloading-size), each load-tested with vLLM's
# prefix-repetition workload: 48 prefixes of 4,096 tokens (three device pools' worth),
# 192 prompts (4 a prefix, shuffled) of 64 more tokens, 32 tokens out, 16 in flight.
# Here: python bench/bench_http.py prepare; then bash bench/run_r43_http.sh SHA
# (carry .whl and .benchdata; about 6 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r43-http.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,memory.total --format=csv,noheader
SERVE="--load-format dummy --dtype bfloat16 --max-model-len 4352 --max-num-seqs 16
  --max-num-batched-tokens 8192 --kv-cache-memory 8GiB --log-level info"
LOAD="--dataset-name prefix-repetition --prefix-repetition-prefix-len 4096
  --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 48 --num-prompts 192
  --random-output-len 32 --ignore-eos --max-concurrency 16 --seed 0 --no-progress --no-plot"
for tier in 0 40; do
  step "tier $tier GiB"
  timeout 330 python3 bench/bench_http.py run --out "$OUT/http-tier$tier" --deadline-s 320 \
    --startup-timeout-s 200 --serve-flags "$SERVE --kv-offloading-size $tier" \
    --loadtest-flags "$LOAD" > "$OUT/http-tier$tier.log" 2>&1 || echo "exit $?"
  tail -4 "$OUT/http-tier$tier.log" | cut -c1-300
  grep -E "KV offloading|capacity:|prefix cache hits" "$OUT/http-tier$tier/server.log" | tail -3 | cut -c1-300
  python3 - "$OUT/http-tier$tier/http.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("completed", "failed", "duration", "request_throughput",
      "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
      "p99_ttft_ms", "engine")})
PY
done
step done
