#!/usr/bin/env bash
# Two device calls (the first lease of a GPU since the integer path was written,
# 2026-12-05): GPTQ / AWQ / compressed-tensors integer weights measured for the first time.
#   bash bench/run_r30.sh SHA kernel  (about 8 minutes; a first run at 5de14f4, the kernel
#   before its rewrite, is bench/results/h100-2026-12-05-wna16-r30a.json)
#  1. the WNA16 kernel tests compiled on the GPU (bf16 / fp16 / fp32, 4 and 8 bits,
#     act-order, split K) and the tiny Llama's GPTQ / AWQ / pack-quantized steps through
#     captured CUDA graphs against eager and the dequantized twin;
#  2. the kernel against fp16 cuBLAS per llama3-8b layer shape, M = 1 .. 2,048, 4 and 8
#     bits, with act-order too (time_wna16.py);
#   bash bench/run_r30.sh SHA engine  (about 9 minutes)
#  3. a random GPTQ checkpoint of llama3-8b (4-bit, groups of 128; bench/make_int_checkpoint.py,
#     about 5.7 GB on the device's disk);
#  4. batch-1 decode and serving (bench_engine.py --serving-only): the fp16 dummy, then the
#     GPTQ checkpoint in fp16, in the same call.
#   bash bench/run_r30.sh SHA quick   the kernel timing (4-bit) and the GPU tests only
#   bash bench/run_r30.sh SHA all     tests, engine gptq and fp16, kernel timing in one call
#   bash bench/run_r30.sh SHA sweep   a sweep of the kernel's launch (4-bit, M 1 .. 256)
# Results under $OUT; carry [".whl"].
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
PART=${2:?kernel, engine, quick, all or sweep}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
# gpu_tests SECONDS [-k EXPR]: the WNA16 kernel and checkpoint tests, stopping at a failure
gpu_tests() {
  local secs=$1
  shift
  timeout "$secs" python3 -m pytest -q -x -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_wna16.py tests/model/test_int_checkpoint.py "$@" 2>&1 \
    | tail -15 || true
}
# timing SECONDS ARGS...: time_wna16.py (act-order too) into $OUT/wna16.json
timing() {
  local secs=$1
  shift
  timeout "$secs" python3 bench/time_wna16.py --git-commit "$SHA" --act-order \
    --out "$OUT/wna16.json" "$@" 2>&1 | tail -16 || true
}
# checkpoint SECONDS: the random 4-bit GPTQ llama3-8b (groups of 128) in /tmp/llama3-8b-gptq
checkpoint() {
  timeout "$1" python3 bench/make_int_checkpoint.py --shape llama3-8b --format gptq \
    --bits 4 --group-size 128 --out /tmp/llama3-8b-gptq 2>&1 | tail -3 || true
}
# engine NAME SECONDS ARGS...: bench_engine.py --serving-only --dtype float16 into
# $OUT/engine-llama3-8b-NAME.json (log: $OUT/engine-NAME.log), its summary lines printed
engine() {
  local name=$1 secs=$2
  shift 2
  timeout "$secs" python3 bench/bench_engine.py --dtype float16 --serving-only \
    --git-commit "$SHA" --out "$OUT/engine-llama3-8b-$name.json" "$@" \
    > "$OUT/engine-$name.log" 2>&1 || true
  grep -E "linear layers|weights .* GiB|batch-1|serving:" "$OUT/engine-$name.log" \
    | cut -c1-400 || true
  tail -3 "$OUT/engine-$name.log" | cut -c1-400
}
GPTQ=(--model /tmp/llama3-8b-gptq --load-format safetensors --quantization auto)
if [ "$PART" = kernel ]; then
  step "wna16 tests"
  gpu_tests 240
  step "kernel against cuBLAS"
  timing 300 --launch dequant wna16,64,128,128,0,8,3
  python3 - "$OUT/wna16.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
keys = ["w4", "w4[dequant]", "w4[wna16,64,128,128,1,8,3]", "w4_act", "w8", "w8[dequant]"]
print("shape M linear | " + " | ".join(keys))
for r in rows:
    cells = [f"{r[k]['us']:.1f}" if "us" in r.get(k, {}) else "-" for k in keys]
    print(r["shape"], r["m"], r["linear"]["us"], "|", " | ".join(cells))
PY
elif [ "$PART" = engine ]; then
  step "gptq checkpoint llama3-8b"
  checkpoint 150
  step "engine llama3-8b fp16"
  engine fp16 180 --model llama3-8b
  step "engine llama3-8b gptq"
  engine gptq 220 "${GPTQ[@]}"
elif [ "$PART" = quick ]; then  # what a few minutes of device time allow
  step "kernel against cuBLAS (4-bit)"
  timing 90 --bits 4 --m 1 4 16 64 128 512 --launch dequant
  step "wna16 tests (fp16 identity, graphs)"
  gpu_tests 100 -k "(identity and float16) or cuda_graphs"
elif [ "$PART" = all ]; then  # one call of at most 10 minutes, the shortest steps first
  step "wna16 tests (fp16 identity, graphs)"
  gpu_tests 100 -k "(identity and float16) or cuda_graphs"
  step "kernel against cuBLAS (4-bit)"
  timing 70 --bits 4 --m 1 4 16 64 128 512 2048 --launch dequant
  step "gptq checkpoint llama3-8b"
  checkpoint 110
  step "engine llama3-8b gptq"
  engine gptq 170 "${GPTQ[@]}"
  step "engine llama3-8b fp16"
  engine fp16 150 --model llama3-8b
else
  step "kernel launch sweep (4-bit, decode to mid sizes)"
  timeout 500 python3 bench/time_wna16.py --git-commit "$SHA" --sweep --bits 4 \
    --m 1 4 16 64 256 --out "$OUT/wna16-sweep.json" 2>&1 | tail -40 || true
fi
step "done"
