"""What scoring prompts costs (the completions API's ``echo`` with ``logprobs``, lm-eval's
loglikelihood requests): the engine prefills ``--num-prompts`` random prompts of
``--input-len`` tokens, one output token each, ``--concurrency`` at a time, plainly and
with every prompt token scored (``prompt_logprobs``), alternating ``--rounds`` times in
one process. A scored step runs eagerly and puts every prompt row through the LM head and
a float32 log-softmax; the ratio of the two prompt-token rates is that cost.

    python bench/bench_scoring.py --out bench/results/h200-DATE-scoring.json   # GPU machine
    python bench/bench_scoring.py --model smollm2-135m --num-prompts 8 --input-len 128 \\
        --out /tmp/s.json                                                       # CPU check
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_sections import StubTokenizer, random_prompt, run_closed_loop  # noqa: E402
from measure import git_commit  # noqa: E402

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.parallel.state import TPGroup, pick_device  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b", help="a dummy shape")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--top", type=int, default=1, help="prompt_logprobs: alternatives")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    device = pick_device(0, "auto")
    argv = ["serve", a.model, "--load-format", "dummy", "--device", device.type,
            "--max-model-len", "2048", "--max-num-seqs", "64", *a.server_arg]
    cfg = config_from_args(build_parser()[0].parse_args(argv))
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, TPGroup(0, 1, device, None))
    core = EngineCore(runner, StubTokenizer(), cfg.scheduler, cfg.engine)
    vocab = runner.model_config.vocab_size
    rng = random.Random(0)
    def fresh(n: int) -> list[list[int]]:  # new random prompts: no prefix-cache hits
        return [random_prompt(rng, a.input_len, vocab) for _ in range(n)]

    run_closed_loop(core, fresh(8), 1, a.concurrency, None, None, "warm")
    run_closed_loop(core, fresh(8), 1, a.concurrency, None, None, "warm-scored",
                    prompt_logprobs=a.top)
    runs = []
    for r in range(a.rounds):
        for mode, top in (("plain", None), ("scored", a.top)):
            done, wall, steps = run_closed_loop(core, fresh(a.num_prompts), 1, a.concurrency,
                                                None, None, f"{mode}-{r}", prompt_logprobs=top)
            tokens = len(done) * a.input_len
            runs.append({"mode": mode, "round": r, "seconds": round(wall, 3), "steps": steps,
                         "prompt_tok_per_s": round(tokens / wall, 1)})
            print(json.dumps(runs[-1]), flush=True)
    rate = {m: [x["prompt_tok_per_s"] for x in runs if x["mode"] == m]
            for m in ("plain", "scored")}
    sha, dirty = git_commit(a.git_commit)
    doc = {"git_commit": sha, "git_dirty": dirty,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "model": a.model, "server_args": a.server_arg,
           "num_prompts": a.num_prompts, "input_len": a.input_len,
           "concurrency": a.concurrency, "prompt_logprobs": a.top, "runs": runs,
           "scored_over_plain": round(sum(rate["scored"]) / sum(rate["plain"]), 4)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("scored_over_plain", "model", "server_args")}))


if __name__ == "__main__":
    main()
