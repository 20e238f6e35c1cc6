"""Why a drafted step costs what it does on a GPU: one runner of a dummy shape, one
sequence with a long context, then a decode step and drafted steps of 2-8 tokens, each
timed (``measure.time_op``: the median of 20 CUDA-event timings after 3 warm-ups; round
36's figures, at 66e5d1b, were the mean of 20 back-to-back steps) with the graph it selects
(None: eager).

    python bench/spec_step_probe.py --model qwen3-0.6b --dtype float32 [-- --enforce-eager]

``--profile N``: then N decode steps under torch.profiler, the GPU time by kernel (the
table's top rows and ``engine_profiles.KERNEL_CATEGORIES``' sums); ``--profile-tokens 1 5``
profiles the steps of those token counts instead (5: the last token and 4 drafts).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_profiles import by_category  # noqa: E402  (bench/engine_profiles.py)
from measure import time_op  # noqa: E402  (bench/measure.py)

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.plan import SeqChunk, StepPlan  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402


def prefilled_runner(model: str, dtype: str, device: str, context: int, flags: list[str]
                     ) -> tuple[ModelRunner, Callable[[int], StepPlan]]:
    """A runner of a dummy ``model`` (tp 1, 1,024 tokens at most, 64 sequences, ``flags``
    added to the serve flags) with one sequence of ``context`` tokens prefilled, and the
    plan of that sequence's next step over ``n`` tokens: its last token and ``n - 1`` draft
    tokens, every position sampled (``n`` 1: a decode step)."""
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(
        ["serve", model, "--load-format", "dummy", "--dtype", dtype, "--device", device,
         "--max-model-len", "1024", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
         *flags]))
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits,
                         TPGroup(0, 1, torch.device(device), None))
    bs = cfg.scheduler.block_size
    blocks = list(range(-(-(context + 16) // bs)))
    runner.execute(StepPlan.build([SeqChunk(list(range(context)), 0, blocks, True)], bs,
                                  runner.attn))

    def step(n: int) -> StepPlan:
        chunk = SeqChunk(list(range(7, 7 + n)), context, blocks, True, sample_rows=n)
        return StepPlan.build([chunk], bs, runner.attn)

    return runner, step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS")
    p.add_argument("--profile-tokens", type=int, nargs="+", default=[1], metavar="N")
    p.add_argument("flags", nargs="*", help="further serve flags (after --)")
    a = p.parse_args()
    dev = torch.device("cuda")
    runner, step = prefilled_runner(a.model, a.dtype, "cuda", a.context, a.flags)
    graphs = runner.graphs
    print("mixed buckets", None if graphs is None else graphs.mixed_buckets, flush=True)
    for n in (1, 2, 3, 5, 8):
        plan = step(n)
        kind = None if graphs is None else graphs.select(plan)
        seconds = time_op(lambda plan=plan: runner.execute(plan), dev, warmup=3, reps=20)
        print(f"{n} tokens: {seconds * 1e3:.3f} ms a step, graph {kind}", flush=True)
    for n in a.profile_tokens if a.profile else ():
        print(f"{n}-token step:", flush=True)
        profile_steps(runner, step(n), a.profile, dev)
    return 0


def profile_steps(runner: ModelRunner, plan: StepPlan, steps: int, dev: torch.device) -> None:
    """``steps`` executions of ``plan`` under torch.profiler: the kernels' GPU time per step,
    by name (top 15) and by category."""
    runner.execute(plan)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.execute(plan)
        torch.cuda.synchronize(dev)
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.device_time_total / steps
        if us > 0:
            totals[e.key] = us
    cats = by_category(totals.items())
    print(f"profile, us a step ({steps} steps): total {sum(totals.values()):.1f}", flush=True)
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {us:9.1f}  {name[:150]}", flush=True)
    print("  by category:", {k: round(v, 1) for k, v in sorted(cats.items(),
                                                            key=lambda kv: -kv[1])}, flush=True)


if __name__ == "__main__":
    sys.exit(main())
