#!/usr/bin/env bash
# Round 10 on the H200 (issue 15's serving target): more one-warp decode programs an SM
# (DecodeLaunch.maxnreg, 16-key tiles), one device call per invocation:
#   sweep: bench/time_fp8_decode.py --sweep --sweep-set r10 --split-factors 2 4 at the
#     engine's sizes;
#   ab: the sweep's fastest fp8 launch at 64 x 1,152 (the engine's decode size) put in
#     FP8_LAUNCH of a copy of this checkout in /tmp/alt (its split factor as
#     target_programs); bench_engine.py --serving-only, fp8 weights + KV, twice each,
#     alternating this checkout and the copy;
#   tests: the fp8 decode test on the capped 16-key launch, compiled on the GPU.
# Usage (GPU machine, repo root, .whl carried; everything packed into OUT_DIR.tgz):
#   bash bench/run_r10.sh OUT_DIR GIT_SHA [sweep] [ab] [tests]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "sweep ab tests" "${@:3}"
if has sweep; then
  step "decode sweep r10"
  timeout 200 python3 bench/time_fp8_decode.py --sweep --sweep-set r10 --split-factors 2 4 \
    --sizes 8:1152,16:2048,64:1152,128:2048 --out "$out/decode-r10.json" \
    > "$out/decode-r10.log" 2>&1
  sweep_summary "$out/decode-r10.json" 5
fi
if has ab; then
  rm -rf /tmp/alt && mkdir -p /tmp/alt && cp -r tpserve bench /tmp/alt/
  python3 - "$out/decode-r10.json" <<'PY' | tee "$out/alt-launch.txt" || exit 1
import ast, json, re, sys
from tpserve.model.kernels.triton_decode_attention import DecodeLaunch
row = next(r for r in json.load(open(sys.argv[1]))["rows"] if r["batch"] == 64)
us, key = min((v["us"], k) for k, v in row.items() if k.startswith("fp8[") and isinstance(v, dict))
fields, _, factor = key.removeprefix("fp8").partition(",x")  # time_fp8_decode.py's names
# the split factor as target_programs: 64 sequences x 8 KV heads x the splits
launch = DecodeLaunch(*ast.literal_eval(fields))._replace(target_programs=64 * 8 * int(factor or 1))
p = "/tmp/alt/tpserve/model/kernels/triton_decode_attention.py"
s = open(p).read()
old = re.search(r"^FP8_LAUNCH = DecodeLaunch\(.*?\)$", s, re.M | re.S)[0]
open(p, "w").write(s.replace(old, f"FP8_LAUNCH = {launch!r}"))
print("fastest at 64 x 1,152:", key, us, "us; /tmp/alt: FP8_LAUNCH =", launch)
PY
  for i in 1 2; do
    step "engine both, this checkout ($i)"; engine_mode "$out" "both" "$sha" 0
    mv "$out/engine-both.json" "$out/engine-both-base$i.json"
    mv "$out/engine-both.log" "$out/engine-both-base$i.log"
    step "engine both, /tmp/alt ($i)"
    (cd /tmp/alt && PYTHONPATH=/tmp/site:/tmp/alt engine_mode "$out" "both" "$sha" 0)
    mv "$out/engine-both.json" "$out/engine-both-alt$i.json"
    mv "$out/engine-both.log" "$out/engine-both-alt$i.log"
  done
fi
if has tests; then
  step "tests"
  timeout 100 python3 -m pytest -q -rs -p no:cacheprovider -k "launch9" \
    tests/model/test_triton_fp8_kv.py::test_decode_attention_over_fp8 > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
round_pack
