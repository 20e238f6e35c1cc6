#!/usr/bin/env bash
# One device call for the FP8 KV cache: the kernel, graph and FP8 tests compiled on the GPU,
# decode attention over bf16 vs FP8 caches (llama3-8b shapes), then bench_engine.py with
# the default (bf16) cache and with --kv-cache-dtype fp8 (capacity and speed). ~8 minutes.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   bash bench/run_fp8kv.sh OUT_DIR GIT_SHA
set -uo pipefail
out=$1 sha=$2; shift 2
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$out/nvidia-smi.csv"
# 1. tests, compiled (CPU-only oracle tests skip themselves on CUDA)
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_fp8_kv.py \
  tests/model/test_triton_kernels.py tests/model/test_cuda_graph_path.py 2>&1 | tail -15 \
  | tee "$out/gpu-tests.txt"
# 2. decode attention: bf16 vs fp8 cache
timeout 45 python3 bench/time_fp8_decode.py --out "$out/fp8-decode.json" 2>&1 \
  | tee "$out/fp8-decode.log"
# 3. the engine, default cache then fp8 (shortened phases so both fit in one call)
for kv in auto fp8; do
  timeout 150 python3 bench/bench_engine.py --kv-cache-dtype "$kv" --num-prompts 192 \
    --serving-time-limit 30 --decode-output-len 128 --prefill-reps 2 --warmup-prompts 32 \
    --out "$out/engine-$kv.json" --git-commit "$sha" "$@" 2>&1 | tee "$out/engine-$kv.log"
done
python3 - "$out" <<'PY' | tee "$out/fp8kv-summary.txt"
import json, sys
for kv in ("auto", "fp8"):
    try:
        r = json.load(open(f"{sys.argv[1]}/engine-{kv}.json"))
    except (OSError, ValueError) as e:
        print(kv, "no result:", e)
        continue
    plan = r.get("memory_plan_bytes", {})
    print(kv, plan.get("kv_cache_dtype"), "kv tokens", plan.get("kv_tokens"),
          "| batch-1", r.get("decode_batch1", {}).get("tok_per_s"), "tok/s",
          "| serving", r.get("serving", {}).get("output_tok_per_s"), "tok/s")
    print("  ", *[line for line in r.get("memory_plan", []) if "capacity" in line])
PY
