#!/usr/bin/env bash
# One device call (~8 min): memory you can see, on a real server.
#   bash bench/run_mem.sh OUT_DIR GIT_SHA      (GPU machine, repo root, .whl carried)
# 1. serve dummy llama3-8b with --memory-history; 2. a little load; 3. /metrics, /memory,
# /memory?fresh=true, `tpserve memory` (table + PNG); 4. plan vs allocator within 2 % on
# every rank; 5. the allocator snapshot through `tpserve memory --snapshot`: it must
# unpickle with segments and device_traces (memory-snapshot-check.txt); 6. a second server
# on the same GPU, whose refusal (exit code and message) is kept; 7. NVTX: a short engine
# bench under nsys with --nvtx, the named ranges listed (skipped when nsys is absent).
# Every step is under `timeout`.
set -uo pipefail
out=$1 sha=$2
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
echo "$sha" > "$out/git-sha.txt"
model=llama3-8b  # a dummy shape; its tokenizer is the embedded SmolLM2's, or .benchdata's
[ -d .benchdata/llama3-8b ] && model=.benchdata/llama3-8b
flags=("$model" --served-model-name llama3-8b --load-format dummy --max-model-len 8192 --max-num-seqs 64
       --max-num-batched-tokens 8192 --log-level info)
p1=8431 p2=8432
timeout 20 nvidia-smi > "$out/nvidia-smi-before.txt" 2>&1
python3 -m tpserve.cli serve "${flags[@]}" --memory-history --port $p1 \
  > "$out/server1.log" 2>&1 &
s1=$!
ok=0
for _ in $(seq 200); do
  if curl -sf "http://127.0.0.1:$p1/health" > /dev/null; then ok=1; break; fi
  kill -0 $s1 2>/dev/null || break
  sleep 1
done
echo "server1 healthy: $ok" | tee "$out/steps.txt"
# a little load: 96 requests of 2048 prompt tokens (token ids), 64 out, 32 at a time,
# so prefill steps of 8192 tokens reserve the activation workspace
timeout 150 python3 - "$p1" > "$out/load.txt" 2>&1 <<'PY'
import sys, random, httpx
from concurrent.futures import ThreadPoolExecutor
base = f"http://127.0.0.1:{sys.argv[1]}/v1/completions"
rng = random.Random(0)
def one(i):
    body = {"model": "llama3-8b", "prompt": [rng.randrange(100, 30000) for _ in range(2048)],
            "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    return httpx.post(base, json=body, timeout=120).status_code
with ThreadPoolExecutor(32) as pool:
    codes = list(pool.map(one, range(96)))
print("status codes:", {c: codes.count(c) for c in set(codes)})
PY
echo "load rc $?" | tee -a "$out/steps.txt"
sleep 3  # one more memory sample after the load
timeout 20 curl -s "http://127.0.0.1:$p1/metrics" > "$out/metrics.txt"
timeout 20 curl -s "http://127.0.0.1:$p1/memory" > "$out/memory.json"
timeout 90 curl -s "http://127.0.0.1:$p1/memory?fresh=true" > "$out/memory-fresh.json"
# the allocator's history since start-up (weights, profile, KV pool, graphs, the load)
timeout 150 python3 -m tpserve.cli memory --base-url "http://127.0.0.1:$p1" \
  --snapshot "$out/memory-snapshot.pickle" > "$out/memory-snapshot.txt" 2>&1
echo "tpserve memory --snapshot rc $?" | tee -a "$out/steps.txt"
timeout 120 python3 - "$out/memory-snapshot.pickle" > "$out/memory-snapshot-check.txt" 2>&1 <<'PY'
import collections, pickle, sys
with open(sys.argv[1], "rb") as f:
    snap = pickle.load(f)
segs, traces = snap["segments"], snap["device_traces"]
events = [e for t in traces for e in t]
actions = collections.Counter(e["action"] for e in events)
print(f"segments {len(segs)}, {sum(s['total_size'] for s in segs) / 2**30:.2f} GiB; "
      f"device_traces {len(traces)} devices, {len(events)} events: {dict(actions)}")
framed = sum(1 for e in events if e.get("frames"))
print(f"events with Python frames: {framed}")
ok = bool(segs) and bool(events) and actions["alloc"] > 0
print("PASS: unpickles, has segments and device_traces with events" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
echo "snapshot check rc $?" | tee -a "$out/steps.txt"
timeout 60 python3 -m tpserve.cli memory --base-url "http://127.0.0.1:$p1" \
  --png "$out/memory.png" --json "$out/memory-report.json" > "$out/memory-table.txt" 2>&1
echo "tpserve memory rc $?" | tee -a "$out/steps.txt"
timeout 20 python3 - "$out/memory.json" > "$out/plan-vs-allocator.txt" 2>&1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bad = 0
for x in r["ranks"]:
    d = x["plan_disagreement"]
    print(f"rank {x['rank']}: plan {x['plan']['held'] / 2**30:.2f} GiB, reserved "
          f"{x['allocator']['reserved'] / 2**30:.2f} GiB, disagreement {100 * d:+.2f} %, "
          f"cuda_graphs {x['plan']['cuda_graphs'] / 2**30:.2f} GiB")
    bad += abs(d) > 0.02
print("PASS: within 2 %" if not bad else "FAIL: beyond 2 %")
sys.exit(1 if bad else 0)
PY
echo "plan vs allocator rc $?" | tee -a "$out/steps.txt"
grep -E "memory plan|weights|outside the allocator|allocator reserves|capacity" "$out/server1.log" \
  > "$out/plan-lines.txt"
timeout 20 nvidia-smi > "$out/nvidia-smi-during.txt" 2>&1
# a second server on the GPU the first one fills: refused with the explanation
timeout 240 python3 -m tpserve.cli serve "${flags[@]}" --port $p2 > "$out/server2.log" 2>&1
echo "second server exit code $?" | tee -a "$out/steps.txt"
grep -n -A12 "tpserve: error" "$out/server2.log" > "$out/refusal.txt"
kill -TERM $s1; timeout 60 tail --pid=$s1 -f /dev/null
echo "server1 stopped" | tee -a "$out/steps.txt"
# NVTX: a server with --nvtx under Nsight Systems, four short requests (token-id prompts:
# dummy weights have no tokenizer); the NVTX summary lists schedule, prepare, forward,
# sample, finalize (graph replays show only "forward"; eager steps also the collectives)
if command -v nsys > /dev/null; then
  timeout 300 nsys profile -t cuda,nvtx -o "$out/nvtx" --force-overwrite true \
    python3 -m tpserve.cli serve "$model" --served-model-name llama3-8b --load-format dummy --max-model-len 2048 \
      --max-num-seqs 8 --nvtx --port $p2 > "$out/nvtx-server.log" 2>&1 &
  s3=$!
  ok=0
  for _ in $(seq 200); do
    if curl -sf "http://127.0.0.1:$p2/health" > /dev/null; then ok=1; break; fi
    kill -0 $s3 2>/dev/null || break
    sleep 1
  done
  echo "nvtx server healthy: $ok" | tee -a "$out/steps.txt"
  for _ in 1 2 3 4; do
    timeout 60 curl -s "http://127.0.0.1:$p2/v1/completions" -H 'Content-Type: application/json' \
      -d '{"model":"llama3-8b","prompt":[100,200,300,400],"max_tokens":16,"ignore_eos":true}' \
      > /dev/null
  done
  # SIGTERM to the server itself (not to nsys): it drains and exits, then nsys writes
  srv=$(pgrep -f "^python3 -m tpserve.cli serve .*--nvtx --port $p2" | head -1)
  if [ -n "$srv" ]; then kill -TERM "$srv"; else kill -TERM $s3; fi
  timeout 180 tail --pid=$s3 -f /dev/null
  timeout 120 nsys stats -r nvtx_sum "$out/nvtx.nsys-rep" > "$out/nvtx-ranges.txt" 2>&1 \
    || timeout 120 nsys stats -r nvtxsum "$out/nvtx.nsys-rep" > "$out/nvtx-ranges.txt" 2>&1
  grep -cE "schedule|prepare|forward|sample|finalize" "$out/nvtx-ranges.txt" \
    | sed 's/^/named NVTX rows: /' | tee -a "$out/steps.txt"
  rm -f "$out/nvtx.sqlite"
else
  echo "nsys not found: NVTX check skipped (ranges unverified on GPU)" | tee -a "$out/steps.txt"
fi
