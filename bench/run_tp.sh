#!/usr/bin/env bash
# Tensor parallelism on a machine with several H200s (nvidia-h200-x2 or -x4), two calls:
#   bash bench/run_tp.sh OUT SHA correctness   # bench_tp.py: tp 1/2/4 vs tp 1 in both
#                                              # --tp-comm modes, collectives' bus bandwidth
#   bash bench/run_tp.sh OUT SHA engine        # bench_engine.py --serving-only at tp 2 and 4
#                                              # in both --tp-comm modes, then the same at
#                                              # tp 2 with --disable-custom-all-reduce
#   bash bench/run_tp.sh OUT SHA http70b       # tpserve serve -tp 4 with llama3-70b (x4 only)
# (.whl and .benchdata carried; TP sizes above the GPU count are skipped.)
set -uo pipefail
out=$1 sha=$2 stage=$3
. "$(dirname "$0")/gpu_env.sh"
gpus=$(nvidia-smi -L | wc -l)
sizes=""; for t in 1 2 4; do [ "$t" -le "$gpus" ] && sizes="$sizes $t"; done
nvidia-smi topo -m > "$out/topo.txt" 2>&1
if [ "$stage" = correctness ]; then
  timeout 540 python3 bench/bench_tp.py --tp $sizes --tp-comm allreduce allgather \
    --out "$out/tp.json" --git-commit "$sha" \
    2>&1 | tee "$out/tp.log"
elif [ "$stage" = engine ]; then
  for t in $sizes; do
    [ "$t" = 1 ] && continue
    for mode in allreduce allgather; do
      timeout 150 python3 bench/bench_engine.py --serving-only --tensor-parallel-size "$t" \
        --tp-comm "$mode" --out "$out/engine-tp$t-$mode.json" --git-commit "$sha" 2>&1 \
        | grep -E "batch-1|serving:"
    done
  done
  if [ "$gpus" -ge 2 ]; then
    timeout 150 python3 bench/bench_engine.py --serving-only --tensor-parallel-size 2 \
      --disable-custom-all-reduce --out "$out/engine-tp2-nccl.json" --git-commit "$sha" \
      2>&1 | grep -E "batch-1|serving:"
  fi
else
  if [ "$gpus" -ge 4 ]; then
    timeout 280 python3 bench/bench_http.py run --out "$out/http70b" --deadline-s 260 \
      --serve-flags "--load-format dummy --dtype bfloat16 --max-model-len 2048 \
--max-num-seqs 64 --max-num-batched-tokens 8192 --tensor-parallel-size 4" \
      --model llama3-70b --loadtest-flags "--num-prompts 128 --max-concurrency 64 \
--random-input-len 1024 --random-output-len 128 --random-range-ratio 0 --ignore-eos \
--dataset random --seed 0 --num-warmups 8 --no-progress --no-plot" 2>&1 | tail -20
  fi
fi
