#!/usr/bin/env bash
# Issue 15 round 4 on the H200, one device call:
#   the fp8 decode-attention launches with the scores as K q^T and/or the grid KV head first
#   (bench/time_fp8_decode.py --sweep --sweep-set r4, both caches), then the allocation
#   probe (bench/segments_probe.py, memory history on) over bench_engine.py's serving
#   workload (640 x 1,024 in / 256 out, c = 64) with fp8 weights + KV, to find the one
#   448 MiB segment the round-3 serving runs created;
#   final: the fp8 kernels' GPU tests, bench_engine.py --serving-only (no profile) for fp8
#   weights + KV, fp8 weights and bf16 in one lease, and bench/fp8_accuracy.py on dummy
#   Llama-3-8B (2,000-token prompt), packed into OUT_DIR/r4-final.tgz.
# Usage (on the GPU machine, from the repo root, .whl carried):
#   segtrace: bench_engine.py --serving-only --serving-memory-history with fp8 weights (the
#     stack behind the segment, in the process that makes it), then bf16 once more;
#   bash bench/run_fp8_r4.sh OUT_DIR GIT_SHA [sweep] [probe] [final] [segtrace]
set -uo pipefail
out=$1 sha=$2
shift 2
parts=("${@:-sweep probe}")
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
if [[ " ${parts[*]} " == *" sweep "* ]]; then
  step "decode sweep r4"
  timeout 240 python3 bench/time_fp8_decode.py --sweep --sweep-set r4 \
    --sizes 64:1152,128:2048,16:2048,1:1152 --out "$out/decode-r4.json" > "$out/decode-r4.log" 2>&1
  tail -3 "$out/decode-r4.log" | cut -c1-300
  sweep_summary "$out/decode-r4.json"
fi
if [[ " ${parts[*]} " == *" probe "* ]]; then
  step "segments probe, fp8 weights + KV, bench_engine's workload"
  timeout 300 python3 bench/segments_probe.py --out "$out/segments-probe-fp8.json" \
    --git-commit "$sha" --num-prompts 640 --output-len 256 --quantization fp8 \
    --kv-cache-dtype fp8 > "$out/segments-probe-fp8.log" 2>&1
  tail -40 "$out/segments-probe-fp8.log" | cut -c1-300
fi
if [[ " ${parts[*]} " == *" final "* ]]; then
  res=$out/r4-final
  mkdir -p "$res"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
    --format=csv > "$res/nvidia-smi.csv"
  step "tests"
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_fp8_kernels.py \
    tests/model/test_fp8.py "tests/model/test_triton_fp8_kv.py::test_decode_attention_over_fp8" \
    > "$res/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED" "$res/gpu-tests.txt" | tail -5
  for mode in both fp8w bf16; do step "engine $mode"; engine_mode "$res" "$mode" "$sha" 0; done
  step "accuracy, dummy llama3-8b"
  timeout 120 python3 bench/fp8_accuracy.py --model llama3-8b --load-format dummy \
    --max-prompt-len 2000 --modes base fp8-weights both --git-commit "$sha" \
    --out "$res/fp8-accuracy-dummy8b.json" > "$res/fp8-accuracy-dummy8b.log" 2>&1
  tail -3 "$res/fp8-accuracy-dummy8b.log" | cut -c1-400
  tar -C "$out" -czf "$out/r4-final.tgz" r4-final && rm -rf "$res"
fi
if [[ " ${parts[*]} " == *" segtrace "* ]]; then
  step "engine fp8w, memory history on during serving"
  timeout 240 python3 bench/bench_engine.py --serving-only --serving-memory-history \
    --quantization fp8 --out "$out/segtrace-fp8w.json" --git-commit "$sha" \
    > "$out/segtrace-fp8w.log" 2>&1
  python3 - "$out/segtrace-fp8w.json" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))["allocator"]
print("new segments", a.get("new_segments"), "freed in trace", a.get("freed_in_trace"))
for c in a.get("created_in_trace", []):
    print(c["size"], c["pool"], c["first_alloc_size"])
    print("   " + "\n   ".join(c["stack"][:25]))
PY
  step "engine bf16 again"
  engine_mode "$out" bf16 "$sha" 0
fi
step done
