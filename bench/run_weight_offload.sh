#!/bin/bash
# Round 49 (one GPU): --cpu-offload-gb's CUDA tests (the copies on a side stream, captured in
# the graphs), the sleep and KV-offload CUDA tests (host_copy.lock_in_place shared by both),
# then bench/weight_offload.py at 0, 4 and 10 GiB offloaded (dummy Llama-3-8B, bf16).
#   bash bench/run_weight_offload.sh SHA   (carry .whl and .benchdata)
source bench/gpu_env.sh
sha=$1
out=$OUT/r49
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
  --format=csv > "$out/nvidia-smi.csv"
step tests
timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  tests/model/test_weight_offload.py tests/model/test_sleep_cuda.py \
  tests/model/test_kv_offload.py tests/server/engine/test_kv_offload_engine.py \
  > "$out/tests.log" 2>&1
tail -5 "$out/tests.log"
for gib in 0 4 10; do
  step "offload $gib GiB"
  base=()
  [ "$gib" != 0 ] && base=("$out/offload-0.json")
  timeout 200 python3 bench/weight_offload.py .benchdata/llama3-8b "$gib" "$sha" "${base[@]}" \
    > "$out/offload-$gib.json" 2> "$out/offload-$gib.log"
  echo "exit $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('tokens'); print(json.dumps(d))" \
    "$out/offload-$gib.json" || tail -5 "$out/offload-$gib.log"
done
step done
