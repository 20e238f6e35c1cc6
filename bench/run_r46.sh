#!/usr/bin/env bash
# Round 46: round 45's staggered host-tier run again, with the tier's loads on a copy
# stream beside the steps (a sequence waits for its own loads while the others decode);
# first the GPU tests of the copy stream and of the engine over it.
# Then the same run at the commit before (2fed6f6, its tpserve and bench scripts under
# ab/base, git-ignored) on the same machine, the baseline.
#   bash bench/run_r46.sh SHA   (carry .whl, .benchdata and ab; about 5 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r46.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
summary() {
python3 - "$1" <<'PY' || true
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    for r in run["rounds"]:
        print(run["offload_gib"], "GiB round", r["round"], "wall", r["wall_s"],
              "out", r.get("output_tokens"), "ttft", r["ttft_ms"], "itl", r["itl_ms"])
        print("   calls", {k: v for k, v in r["step_call_ms"].items() if k != "slowest"})
        print("   slowest", r["step_call_ms"]["slowest"])
        print("   stored", r.get("kv_offload_stored_blocks_total"),
              "loaded", r.get("kv_offload_loaded_blocks_total"),
              "hits", r.get("prefix_cache_hits_total"))
    print("   vs first run:", run.get("last_round_vs_first_run"))
PY
}
step "GPU tests: the copy stream, the engine over it"
timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_kv_offload.py tests/server/engine/test_kv_offload_engine.py -k "cuda" 2>&1 \
  | tail -15 || true
step "offload (engine, staggered)"
timeout 200 python3 bench/bench_offload.py --offload 0,40 --stagger --git-commit "$SHA" \
  --out "$OUT/offload_stagger.json" > "$OUT/offload_stagger.log" 2>&1 || echo "exit $?"
summary "$OUT/offload_stagger.json"
grep -E "Error|error" "$OUT/offload_stagger.log" | head -5
if [ -d ab/base ]; then
  step "baseline: 2fed6f6, loads on the forward's stream"
  timeout 200 python3 ab/base/bench/bench_offload.py --model .benchdata/llama3-8b --offload 40 \
    --stagger --git-commit 2fed6f6 --out "$OUT/offload_stagger_base.json" \
    > "$OUT/offload_stagger_base.log" 2>&1 || echo "exit $?"
  summary "$OUT/offload_stagger_base.json"
fi
step done
