"""Why a drafted step costs what it does on a GPU: one runner of a dummy shape, one
sequence with a long context, then a decode step and drafted steps of 2-8 tokens, each
timed (``measure.time_op``: the median of 20 CUDA-event timings after 3 warm-ups; round
36's figures, at 66e5d1b, were the mean of 20 back-to-back steps) with the graph it selects
(None: eager).

    python bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 [-- --enforce-eager]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import time_op  # noqa: E402  (bench/measure.py)

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.plan import SeqChunk, StepPlan  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("flags", nargs="*", help="further serve flags (after --)")
    a = p.parse_args()
    dev = torch.device("cuda")
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(
        ["serve", a.model, "--load-format", "dummy", "--dtype", a.dtype, "--device", "cuda",
         "--max-model-len", "1024", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
         *a.flags]))
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, TPGroup(0, 1, dev, None))
    bs = cfg.scheduler.block_size
    blocks = list(range(-(-(a.context + 16) // bs)))
    runner.execute(StepPlan.build([SeqChunk(list(range(a.context)), 0, blocks, True)], bs,
                                  runner.attn))
    graphs = runner.graphs
    print("mixed buckets", None if graphs is None else graphs.mixed_buckets, flush=True)
    for n in (1, 2, 3, 5, 8):
        chunk = SeqChunk(list(range(7, 7 + n)), a.context, blocks, True, sample_rows=n)
        plan = StepPlan.build([chunk], bs, runner.attn)
        kind = None if graphs is None else graphs.select(plan)
        seconds = time_op(lambda plan=plan: runner.execute(plan), dev, warmup=3, reps=20)
        print(f"{n} tokens: {seconds * 1e3:.3f} ms a step, graph {kind}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
