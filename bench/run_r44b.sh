#!/usr/bin/env bash
# Round 44, second call: where the host tier's inter-token latency comes from, in the
# engine (loads on the forward's stream again: the copy stream of the first call is
# reverted). bench_offload.py (round 43's workload) without a tier and with 40 GiB, now
# reporting per round the inter-token latency and the step calls' times by the copies
# listed in them.
#   bash bench/run_r44b.sh SHA   (carry .whl and .benchdata; about 2 minutes)
source bench/gpu_env.sh
SHA=${1:?commit of this tree}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" && exec > >(tee "$OUT/r44b.txt") 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total --format=csv,noheader
step "offload (engine)"
timeout 300 python3 bench/bench_offload.py --offload 0,40 --git-commit "$SHA" \
  --out "$OUT/offload.json" > "$OUT/offload.log" 2>&1 || echo "exit $?"
python3 - "$OUT/offload.json" <<'PY' || true
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    for r in run["rounds"]:
        print(run["offload_gib"], "GiB round", r["round"],
              "wall", r["wall_s"], "ttft", r["ttft_ms"], "itl", r["itl_ms"])
        print("   calls", {k: v for k, v in r["step_call_ms"].items() if k != "slowest"})
        print("   slowest", r["step_call_ms"]["slowest"])
    print("   vs first run:", run.get("last_round_vs_first_run"))
PY
grep -E "Error|error" "$OUT/offload.log" | head -5
step done
