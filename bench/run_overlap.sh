#!/usr/bin/env bash
# Decode attention beside prefill attention (--overlap-attention) on the GPU machine. Carry .whl.
#   bash bench/run_overlap.sh OUT SHA [PART...]   parts: tests timing sweep engine engine2
#   profile (default: tests timing engine)
# tests: the attention and CUDA-graph tests (Triton compiled, against the torch reference;
# two streams against one, eager and in graphs); timing: bench/time_attention_overlap.py;
# sweep: the same with --sweep (decode splits, launch order, stream priority);
# engine: bench_engine.py --serving-only, fp8 weights + KV, overlap on / off;
# engine2: the same pair again, then bf16 on / off (the lease's drift shows in the pairs);
# profile: fp8 weights + KV and bf16 at the defaults, 400 serving steps profiled.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests timing engine" "${@:3}"
if has tests; then
  step "attention tests"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_triton_kernels.py \
    tests/model/test_cuda_graph_path.py tests/model/test_attention_overlap.py \
    tests/model/test_triton_fp8_kv.py -k "two_streams or captured or overlap or graph_padding or padding_sequence or decode_attention_over" \
    > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has timing; then
  step "decode and prefill attention, one stream / two"
  timeout 150 python3 bench/time_attention_overlap.py --out "$out/attention-overlap.json" \
    > "$out/attention-overlap.log" 2>&1
  cut -c1-400 "$out/attention-overlap.log"
fi
if has sweep; then
  step "the overlap's knobs"
  timeout 200 python3 bench/time_attention_overlap.py --sweep --out "$out/attention-overlap-sweep.json" \
    > "$out/attention-overlap-sweep.log" 2>&1
  python3 - "$out/attention-overlap-sweep.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    best = sorted((v["us"], k, v["max_abs_diff"]) for k, v in r.items() if isinstance(v, dict))
    print(r["case"], r["cache"], "sequential", r["sequential_us"], "best:", best[:4])
PY
fi
if has engine; then
  for mode in both both-noovl; do
    step "engine, $mode"
    engine_mode "$out" "$mode" "$sha" 0
  done
fi
if has engine2; then
  for mode in both-noovl both bf16 bf16-noovl; do
    step "engine, $mode"
    engine_mode "$out" "$mode" "$sha" 0
  done
fi
if has profile; then
  for mode in both bf16; do
    step "engine, $mode, profiled"
    engine_mode "$out" "$mode" "$sha" 400
  done
fi
round_pack
