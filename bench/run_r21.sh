#!/usr/bin/env bash
# Round 21 (issue 15) on the GPU machine: the per-channel Triton W8A8 kernel's K split at the
# decode buckets (2-64 tokens).
#   bash bench/run_r21.sh OUT SHA [PART...]   parts: sweep tests ab caps (default: sweep)
# sweep: bench/fp8_gemm.py at M = 2 8 16 32 48 64 with the table launches and every launch of
# SPLITS (fast accumulation, as served), compiled first by 8 processes. tests: the GPU tests
# of the W8A8 and fp8 kernels and the CUDA-graph path. ab: fp8 weights + KV serving at
# concurrency C (default 64; 10 x C prompts), AB_ROUNDS rounds (default 2) alternating this
# tree and a copy with .whl/r21.patch reversed (carry it: `git diff BASE HEAD -- tpserve`).
# caps: fp8 weights + KV serving at concurrency C with each step budget while sequences
# decode in CAPS (default "512 1024 2048 8192 512"; a cap above 512 also captures graphs up
# to it when GRAPHS=1), one run each, in that order.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "sweep" "${@:3}"
SPLITS=(w8a8,64,64,256,1,4,5 w8a8,64,64,256,2,4,5 w8a8,64,64,256,3,4,5 w8a8,64,64,256,4,4,5
        w8a8,64,64,256,6,4,5 w8a8,64,64,256,8,4,5 w8a8,64,32,256,1,4,4 w8a8,64,32,256,2,4,4
        w8a8,64,32,256,3,4,4 w8a8,64,32,256,4,4,4 w8a8,64,128,128,2,4,4 w8a8,64,128,128,3,4,4
        w8a8,64,64,128,4,4,6 w8a8,64,64,128,8,4,6 w8a8,16,64,256,2,4,4 w8a8,16,64,256,4,4,4)
if has sweep; then
  step "compile the launches (8 processes)"
  for w in 0 1 2 3 4 5 6 7; do
    timeout 300 python3 bench/fp8_gemm.py --m 2 8 16 32 48 64 --compile-only --worker "$w/8" \
      --w8a8 "${SPLITS[@]}" > "$out/compile-$w.log" 2>&1 &
  done
  wait
  step "time them"
  timeout 400 python3 bench/fp8_gemm.py --m 2 8 16 32 48 64 --w8a8 "${SPLITS[@]}" \
    --out "$out/fp8-gemm-splits.json" --commit "$2" > "$out/fp8-gemm-splits.log" 2>&1
  grep -m3 -i error "$out/fp8-gemm-splits.log" | cut -c1-600
  python3 - "$out/fp8-gemm-splits.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    fast = sorted((v["us"], k) for k, v in r.items()
                  if k.startswith("w8a8_fast[") and isinstance(v, dict) and "us" in v)
    print(f'{r["shape"]:8} {r["m"]:3} table {r.get("w8a8_fast", {}).get("us")} '
          f'({r["w8a8_fast_config"]}) best: ' + ", ".join(f"{u} {k[10:-1]}" for u, k in fast[:3]))
PY
fi
if has tests; then
  step "W8A8, fp8 kernel and CUDA-graph tests"
  timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_w8a8.py tests/model/test_fp8_kernels.py \
    tests/model/test_cuda_graph_path.py > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
if has ab; then
  base=/tmp/r21-base
  rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r21.patch) || exit 1
  c=${C:-64}
  for ((i = 1; i <= ${AB_ROUNDS:-2}; i++)); do
    for spec in "new:." "base:$base"; do
      name=${spec%%:*} tree=${spec#*:}
      step "serving c=$c $name-$i"
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/bench_engine.py \
        --serving-only --quantization fp8 --kv-cache-dtype fp8 --concurrency "$c" \
        --num-prompts $((10 * c)) --out "$out/engine-c$c-$name-$i.json" \
        --git-commit "$2-$name" > "$out/engine-c$c-$name-$i.log" 2>&1)
      grep -E "batch-1|serving:|GPU while" "$out/engine-c$c-$name-$i.log" | cut -c1-400
    done
  done
fi
if has caps; then
  c=${C:-64}
  for cap in ${CAPS:-512 1024 2048 8192 512}; do
    g=(); [ "${GRAPHS:-0}" = 1 ] && [ "$cap" -le 2048 ] && g=(--cuda-graph-max-tokens "$cap")
    step "serving c=$c, step budget $cap while decoding ${g[*]}"
    timeout 150 python3 bench/bench_engine.py --serving-only --quantization fp8 \
      --kv-cache-dtype fp8 --concurrency "$c" --num-prompts $((10 * c)) \
      --max-mixed-tokens "$cap" "${g[@]}" --out "$out/engine-c$c-cap$cap${g:+g}-$SECONDS.json" \
      --git-commit "$2" > "$out/engine-c$c-cap$cap${g:+g}-$SECONDS.log" 2>&1
    f=$(ls -t "$out"/engine-c$c-cap$cap*.log | head -1)
    grep -E "batch-1|serving:|GPU while" "$f" | cut -c1-400
    python3 - "${f%.log}.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])).get("serving", {})
print("  steps", s.get("steps"), s.get("step_tokens", {}).get("steps_per_bucket"),
      "ttft p50/p99", s.get("ttft_ms", {}).get("p50"), s.get("ttft_ms", {}).get("p99"),
      "itl p99", s.get("itl_ms", {}).get("p99"), "J/tok", s.get("joules_per_output_token"))
PY
  done
fi
round_pack
