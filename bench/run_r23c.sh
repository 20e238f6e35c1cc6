#!/usr/bin/env bash
# Round 23, call c: the RoPE + KV write kernel with every load before the first store,
# against the kernel before (this tree with .whl/r23.patch reversed; carry it:
# `git diff HEAD -- tpserve/model/kernels/triton_rope.py tpserve/model/kernels/triton_fp8_kv.py
# > .whl/r23.patch`): time_rope_head_norm.py in both trees, twice, alternating, then the
# kernel tests on the GPU ($TESTS, default the four kernel test files).
#   bash bench/run_r23c.sh OUT SHA
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" ""
out=$(realpath "$out")  # the base runs in another folder
base=/tmp/r23-base
rm -rf "$base" && cp -r . "$base" && (cd "$base" && patch -s -R -p1 < .whl/r23.patch) || exit 1
for i in 1 2; do
  for spec in "new:." "base:$base"; do
    name=${spec%%:*} tree=${spec#*:}
    step "rope $name-$i"
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/time_rope_head_norm.py \
      --out "$out/rope-$name-$i.json" > "$out/rope-$name-$i.log" 2>&1)
    python3 - "$out/rope-$name-$i.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["tokens"], r["cache"], r["rope only"]["us"], r["fused norm"]["us"],
          r["unfused norm"]["us"])
PY
  done
done
step tests
timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider \
  ${TESTS:-tests/model/test_triton_head_norm.py tests/model/test_triton_kernels.py \
  tests/model/test_triton_kv_hadamard.py tests/model/test_triton_fp8_kv.py} > "$out/tests.log" 2>&1
tail -3 "$out/tests.log"
step done
