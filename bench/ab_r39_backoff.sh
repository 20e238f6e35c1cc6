#!/usr/bin/env bash
# Round 39's A/B (one device call): speculative decoding in float32 (spec_decode.py,
# qwen3-0.6b) before the draft backoff (15ed025, from ab/old) and after it (316075f, this
# tree), alternating, two rounds each. Prepare ab/old (git-ignored, carried as "ab"):
#   mkdir -p ab/old && git archive 15ed025 tpserve \
#     $(git ls-tree --name-only 15ed025 bench/ | grep '\.py$') | tar -x -C ab/old
#   cp bench/ab_r39_backoff.sh ab/ab.sh    # then, on the device: bash ab/ab.sh
source bench/gpu_env.sh
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then S=ab/old/bench/spec_decode.py; C=15ed02528f4bad53e487bbdae35636401df6b671; else S=bench/spec_decode.py; C=316075f85af826423aecd5b728c52381e38efc27; fi
    step "$v ($C) run $i"
    timeout 100 python3 $S --git-commit $C --model qwen3-0.6b --dtype float32 --requests 8 --output-len 96 --out "$OUT/ab-$v-$i.json" 2>&1 | grep -v Warning | grep '"ngram"\|"plain"' | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['workload'], r['concurrency'], r['mode'], r['out_tok_s'], r['steps'], r.get('spec_decode_paused_steps_total'))"
  done
done
step done
