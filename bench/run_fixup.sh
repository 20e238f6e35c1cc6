#!/usr/bin/env bash
# The W8A8 kernel's split reduced by the last program of each tile (tile counters) on the
# GPU machine. Carry .whl.
#   bash bench/run_fixup.sh OUT SHA [PART...]   parts: tests gemm engine engine2
#   (default: tests gemm engine)
# tests: the W8A8, fp8-kernel and CUDA-graph tests (GPU: the fixup equals the reduce kernel
# bit for bit on the llama3-8b shapes, in and out of graphs); gemm: bench/fp8_gemm.py at
# M = 48, 64 with explicit launches (tiles, splits) reduced in the GEMM; engine: fp8
# weights + KV with the layers' tile counters and without them (every split launch then
# runs the reduce kernel, as before); engine2: the same pair in the other order.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "tests gemm engine" "${@:3}"
# engine_nofixup DIR SHA: engine_mode's "both" with Fp8LinearMethod giving no layer counters
engine_nofixup() {
  timeout 200 python3 - "$1" "$2" > "$1/engine-both-nofixup.log" 2>&1 <<'PY'
import runpy, sys
import tpserve.model.quant.fp8 as fp8
fp8.Fp8LinearMethod.add_tile_counters = (
    lambda self, layer: layer.register_buffer("w8a8_tile_counters", None, persistent=False))
d, sha = sys.argv[1:3]
sys.argv = ["bench/bench_engine.py", "--serving-only", "--out", f"{d}/engine-both-nofixup.json",
            "--git-commit", sha, "--quantization", "fp8", "--kv-cache-dtype", "fp8",
            "--note", "no W8A8 tile counters: split launches reduce in a second kernel"]
runpy.run_path("bench/bench_engine.py", run_name="__main__")
PY
  grep -E "batch-1|serving:" "$1/engine-both-nofixup.log" | cut -c1-400
}
if has tests; then
  step "W8A8, fp8 kernel and graph tests"
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -n 0 tests/model/test_triton_w8a8.py \
    tests/model/test_fp8_kernels.py tests/model/test_cuda_graph_path.py \
    > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
if has gemm; then
  step "W8A8 launches, split reduced in the GEMM"
  timeout 240 python3 bench/fp8_gemm.py --m 48 64 --replays 9 --out "$out/gemm.json" \
    --w8a8-fixup w8a8,64,128,128,2,4,4 w8a8,64,128,128,3,4,4 w8a8,64,128,128,4,4,4 \
      w8a8,64,128,128,5,4,4 w8a8,64,128,128,8,4,4 w8a8,64,64,128,1,4,4 w8a8,64,64,128,2,4,4 \
      w8a8,64,64,128,4,4,4 w8a8,64,128,128,2,4,3 w8a8,64,128,256,2,4,3 w8a8,64,128,256,4,4,3 \
    > "$out/gemm.log" 2>&1
  python3 - "$out/gemm.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    cells = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict) and "us" in v
                   and (k.startswith(("fixup[", "w8a8")) or k == "mm_fast"))
    eq = r.get("w8a8_fixup", {}).get("equals_w8a8")
    print(r["shape"], r["m"], "w8a8", r["w8a8"].get("us"), "fixup", r["w8a8_fixup"].get("us"),
          "equal", eq, "| best:", cells[:4])
PY
fi
if has engine; then
  step "engine, both (tile counters)"; engine_mode "$out" both "$sha" 0
  step "engine, both without tile counters"; engine_nofixup "$out" "$sha"
fi
if has engine2; then
  step "engine, both without tile counters"; engine_nofixup "$out" "$sha"
  mv "$out/engine-both-nofixup.json" "$out/engine-both-nofixup2.json"
  mv "$out/engine-both-nofixup.log" "$out/engine-both-nofixup2.log"
  step "engine, both (tile counters)"; engine_mode "$out" both "$sha" 0
  mv "$out/engine-both.json" "$out/engine-both2.json"; mv "$out/engine-both.log" "$out/engine-both2.log"
fi
round_pack
