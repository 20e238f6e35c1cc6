#!/usr/bin/env bash
# Round 17 (issue 15) on the GPU machine. Carry .whl.
#   bash bench/run_r17.sh OUT SHA [PART...]   parts: segtrace profile bf16 ab energy
#   decode_energy tests
#   (default: segtrace)
# segtrace: fp8 weights + KV serving with the allocator's history from the warm-up on
# (bench_engine.py --serving-memory-history warmup), so that the report names, for every
# segment the serving run creates, the live allocations that split the cached segments
# big enough to serve it (alloc_trace.segment_blockers); energy: bench/energy_kernels.py,
# joules per call of the serving step's heavy kernels (decode_energy: of the fp8 decode
# launches of energy_kernels.DECODE_SWEEP); profile: fp8 weights + KV serving
# with 400 steps profiled (engine_mode); bf16: bf16 serving, profiled; ab: fp8 weights +
# KV serving twice each, alternating this tree and a copy with .whl/r17-product.patch
# (`git diff BASE HEAD -- tpserve`, made before the call) reversed; tests: the GPU tests of
# the files this round touched.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "segtrace" "${@:3}"
if has segtrace; then
  step "fp8 weights + KV serving, allocator history from the warm-up"
  timeout 300 python3 bench/bench_engine.py --serving-only --quantization fp8 \
    --kv-cache-dtype fp8 --serving-memory-history warmup \
    --out "$out/engine-both-segtrace.json" --git-commit "$2" > "$out/engine-both-segtrace.log" 2>&1
  grep -E "batch-1|serving:|new segments" "$out/engine-both-segtrace.log" | cut -c1-300
  python3 - "$out/engine-both-segtrace.json" <<'PY'
import json, sys
seg = json.load(open(sys.argv[1]))["allocator"]
print("new segments", seg.get("new_segments"), "created", len(seg.get("created_in_trace", [])))
for b in seg.get("blockers", []):
    print("segment of", b["size"], "stream", b["stream"], "at", b["index"])
    print("   made by", b["stack"][:6])
    for c in b["candidates"]:
        print("   candidate", c["total_size"], "stream", c["stream"], "pool", c["pool"],
              "largest free", c["largest_free"], "live", c["live_count"])
        for l in c["live"][:6]:
            print("      ", l["offset"], l["size"], l["index"], l["stack"][:8])
PY
fi
if has profile; then
  step "fp8 weights + KV serving, 400 steps profiled"
  engine_mode "$out" both "$2" 400
fi
if has bf16; then
  step "bf16 serving, 400 steps profiled"
  engine_mode "$out" bf16 "$2" 400
fi
if has ab; then
  base=/tmp/r17-base
  rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r17-product.patch) \
    || exit 1
  alternate "$out" 2 "new:.:$2" "base:$base:$2-r17-product.patch"
fi
if has energy; then
  step "energy per call of the step's kernels"
  timeout 240 python3 bench/energy_kernels.py --commit "$2" --out "$out/energy-kernels.json" \
    > "$out/energy-kernels.log" 2>&1
  tail -34 "$out/energy-kernels.log" | cut -c1-240
fi
if has decode_energy; then
  step "energy per call of fp8 decode-attention launches"
  timeout 240 python3 bench/energy_kernels.py --commit "$2" --decode-sweep \
    --cases idle decode_fp8 decode_attn --out "$out/energy-decode.json" > "$out/energy-decode.log" 2>&1
  grep -E "^(case|idle|decode)" "$out/energy-decode.log" | cut -c1-150
fi
if has tests; then
  step "norm, fp8 fused, sampler and CUDA-graph tests"
  timeout 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_kernels.py tests/model/test_fp8_fused.py tests/model/test_sampler.py \
    tests/model/test_cuda_graph_path.py -k "norm or residual or fused or sampler or greedy or graph" \
    > "$out/gpu-tests.txt" 2>&1
  tail -3 "$out/gpu-tests.txt"
fi
round_pack
