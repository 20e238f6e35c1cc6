# Sourced by every bench/run_*.sh on the GPU machine (repo root, .whl carried): unbuffered
# output, NVLink multicast off (the lent machines do not allow it), the carried wheels
# installed into /tmp/site, and PYTHONPATH set so this checkout's tpserve is imported.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
# step NAME: a progress line with the seconds since this file was sourced
t0=$(date +%s)
step() { echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
# wna16_default_tests: the WNA16 tests of the default launches (the transposed product at
# 2-32 rows, the one-row GEMV, the launch tables, the integer checkpoints' CUDA-graph steps)
wna16_default_tests() {
  timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/model/test_triton_wna16.py tests/model/test_int_checkpoint.py \
    -k "2_to_32 or one_row or gemv or launch or cuda_graphs or transposed" 2>&1 \
    | tail -8 || true
}
# sweep_summary JSON [TOP]: per size of a time_fp8_decode.py sweep, the default launches'
# times and the TOP fastest launches (default: all), with their max |difference|
sweep_summary() {
  python3 - "$1" "${2:-0}" <<'PY'
import json, sys
top = int(sys.argv[2]) or None
for r in json.load(open(sys.argv[1]))["rows"]:
    best = sorted((v["us"], k) for k, v in r.items() if isinstance(v, dict) and "us" in v)
    print(r["batch"], r["context"], "splits", r["splits"], "bf16", r["bf16_us"], "fp8", r["fp8_us"])
    for us, k in best[:top]:
        print("   ", us, k, r[k]["max_abs_diff"])
PY
}
# engine_mode DIR MODE[_TAG] SHA [PROFILE_STEPS]: bench_engine.py --serving-only --profile-serving
# PROFILE_STEPS (default 400; 0: no profile) for one mode (bf16, fp8w: --quantization fp8,
# fp8kv: --kv-cache-dtype fp8, both; -fast / -promoted: with --fp8-fast-accum / --no-...;
# -nohad: with --no-kv-cache-hadamard; any of them + -noovl: with --no-overlap-attention),
# into DIR/engine-MODE.*
engine_mode() {
  local dir=$1 mode=$2 sha=$3 prof=${4:-400} flags=() kind=${2%%_*}  # MODE_TAG: a run's tag
  [[ $kind == *-noovl ]] && flags+=(--no-overlap-attention)
  case ${kind%-noovl} in
    fp8w) flags+=(--quantization fp8) ;;
    fp8kv) flags+=(--kv-cache-dtype fp8) ;;
    both) flags+=(--quantization fp8 --kv-cache-dtype fp8) ;;
    fp8w-fast) flags+=(--quantization fp8 --fp8-fast-accum) ;;
    both-fast) flags+=(--quantization fp8 --kv-cache-dtype fp8 --fp8-fast-accum) ;;
    both-promoted) flags+=(--quantization fp8 --kv-cache-dtype fp8 --no-fp8-fast-accum) ;;
    both-nohad) flags+=(--quantization fp8 --kv-cache-dtype fp8 --no-kv-cache-hadamard) ;;
    fp8kv-nohad) flags+=(--kv-cache-dtype fp8 --no-kv-cache-hadamard) ;;
  esac
  [ "$prof" -gt 0 ] && flags+=(--profile-serving "$prof")
  timeout 200 python3 bench/bench_engine.py --serving-only \
    --out "$dir/engine-$mode.json" --git-commit "$sha" "${flags[@]}" \
    > "$dir/engine-$mode.log" 2>&1
  grep -E "weights .* GiB|batch-1|serving:|serving profile" "$dir/engine-$mode.log" | cut -c1-1000
}
# checkpoint_run DIR NAME TREE SHA CKPT [PROFILE_STEPS]: bench_engine.py --serving-only on the
# FP8 checkpoint folder CKPT (fp8 KV cache), run in the copy of the tree TREE, with
# --profile-serving PROFILE_STEPS when given, into DIR/engine-NAME.*
checkpoint_run() {
  local dir=$1 name=$2 tree=$3 sha=$4 ckpt=$5 prof=()
  [ "${6:-0}" -gt 0 ] && prof=(--profile-serving "$6")
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/bench_engine.py \
    --serving-only --model "$ckpt" --load-format safetensors \
    --quantization fp8 --kv-cache-dtype fp8 --out "$dir/engine-$name.json" \
    --git-commit "$sha" "${prof[@]}" > "$dir/engine-$name.log" 2>&1)
  grep -E "linear layers|weights .* GiB|batch-1|serving:|GPU while|serving profile" \
    "$dir/engine-$name.log" | cut -c1-1000
}
# alternate DIR REPS SPEC...: an A/B of fp8 weights + KV serving (engine_mode "both", no
# profile), REPS rounds of the SPECs in order; SPEC is NAME:TREE:SHA, TREE the copy of the
# tree the run starts in ("." this one), into DIR/engine-both_NAME-ROUND.*
alternate() {
  local dir=$1 reps=$2 i spec name tree sha
  shift 2
  for ((i = 1; i <= reps; i++)); do
    for spec in "$@"; do
      IFS=: read -r name tree sha <<< "$spec"
      step "engine both, $name-$i"
      if [ "$tree" = . ]; then
        engine_mode "$dir" "both_$name-$i" "$sha" 0
      else
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree engine_mode "$dir" "both_$name-$i" "$sha" 0)
      fi
    done
  done
}
# round_start OUT SHA DEFAULT_PARTS [PART...]: the opening of a round script (run_fp8_r5.sh,
# run_fp8_r6.sh, run_r8.sh): makes OUT, exports TPSERVE_GIT_COMMIT=SHA (git in the device
# copy reports a stale HEAD), records nvidia-smi's clocks, and keeps the PARTs asked for
# (DEFAULT_PARTS, a space-separated list, when none is) for `has PART`
round_start() {
  out=$1 sha=$2
  local default=$3
  shift 3
  if [ $# -gt 0 ]; then parts=("$@"); else read -ra parts <<< "$default"; fi
  mkdir -p "$out"
  export TPSERVE_GIT_COMMIT=$sha
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used \
    --format=csv > "$out/nvidia-smi.csv"
}
has() { [[ " ${parts[*]} " == *" $1 "* ]]; }
# round_pack: the closing: OUT packed into OUT.tgz (a device call returns at most 8 files)
round_pack() {
  step done
  tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && rm -rf "$out"
}
# NCU: Nsight Compute's command line (on PATH, else the image's install)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# ncu_reports REP PREFIX N: from the ncu report REP, PREFIXdetails.txt (the details page, NVTX
# ranges as kernel names), PREFIXraw.csv (every metric) and PREFIXsass-decode-I.csv (SASS with
# per-instruction stall samples) for the first N _decode_split_kernel launches
ncu_reports() {
  local rep=$1 prefix=$2 n=$3 i
  "$NCU" -i "$rep" --page details --print-nvtx-rename kernel > "${prefix}details.txt" 2>&1
  "$NCU" -i "$rep" --page raw --csv > "${prefix}raw.csv" 2>&1
  for ((i = 0; i < n; i++)); do
    "$NCU" -i "$rep" --page source --print-source sass --csv \
      --kernel-name _decode_split_kernel --launch-skip "$i" --launch-count 1 \
      > "${prefix}sass-decode-$i.csv" 2>&1
  done
}
# serving_ab BASE_SHA NEW_SHA: bench_engine.py --serving-only (dummy llama3-8b, bf16) at
# BASE (the tree unpacked in ab/base: bench_engine.py puts the tree above it first on
# sys.path) and at this tree (NEW), one after the other, into $OUT/serving-{base,new}.*
serving_ab() {
  local v s c
  for v in base new; do
    if [ $v = base ]; then s=ab/base/bench/bench_engine.py; c=$1; else s=bench/bench_engine.py; c=$2; fi
    step "$v ($c)"
    timeout 200 python3 $s --serving-only --git-commit "$c" --out "$OUT/serving-$v.json" \
      > "$OUT/serving-$v.log" 2>&1 || true
    grep -E "batch-1|serving:" "$OUT/serving-$v.log" | cut -c1-300 || true
    tail -2 "$OUT/serving-$v.log" | cut -c1-300
  done
}
# offload_summary JSON: a bench_offload.py result's rounds (wall, TTFT, ITL, the step()
# calls by the copies in them, the copies and hits) and its tokens against the first run
offload_summary() {
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
# offload_stagger NAME SHA OFFLOAD [ROOT]: bench_offload.py --stagger (ROOT's copy, default
# this tree; --offload OFFLOAD) into $OUT/NAME.json and .log, under $OFFLOAD_TIMEOUT s
# (default 420), then its summary and any error lines
offload_stagger() {
  local name=$1 sha=$2 offload=$3 root=${4:-.}
  timeout "${OFFLOAD_TIMEOUT:-420}" python3 "$root/bench/bench_offload.py" \
    --model .benchdata/llama3-8b --offload "$offload" --stagger --git-commit "$sha" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "exit $?"
  offload_summary "$OUT/$name.json"
  grep -E "Error|error" "$OUT/$name.log" | head -5
}
