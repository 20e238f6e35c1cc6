"""Short prompts arriving behind long ones: their time to first token with and without
vLLM's ``--max-num-partial-prefills`` / ``--max-long-partial-prefills`` (the scheduler's
prefill seats), in one ``EngineCore``: on the embedded SmolLM2 (real weights, CPU) by
default, or on ``--model`` with ``--load-format`` (e.g. dummy llama3-8b on a GPU).

Each configuration runs the same scene: two long prompts (``--long`` tokens each, slices of
a public-domain text) are added and one step runs, then ``--shorts`` short prompts
(``--short`` tokens) arrive; every request asks for ``--max-tokens`` greedy tokens. For each
request it records the step and the seconds (from its own arrival) at which its first token
was read back, and the whole run's steps and seconds. The configurations:

- ``default``: no cap but the step's budget (the long prompts take it whole);
- ``threshold``: ``--long-prefill-token-threshold`` alone (each long prompt takes at most
  that many tokens a step, but both together can still fill the budget);
- ``seats``: the threshold with ``--max-num-partial-prefills N --max-long-partial-prefills 1``
  (``--seats N``, default 4: one long prompt prefills at a time; the short ones pass the
  other, N - 1 of them a step).

    python bench/partial_prefills.py --out bench/results/cpu-2026-12-07-partial-prefills.json \
        --git-commit "$(git rev-parse HEAD)"
    python bench/partial_prefills.py --model .benchdata/llama3-8b --load-format dummy \
        --device cuda --long 16384 --short 64 --budget 2048 --threshold 1024 \
        --max-model-len 32768 --kv-cache-memory 8GiB --warmup --out ... --git-commit ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.loader.checkpoint import open_checkpoint  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.model.sampling_params import SamplingParams  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.config import EngineConfig  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.request_state import RequestState  # noqa: E402
from tpserve.server.engine.scheduler import SchedulerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = (ROOT / "tests" / "data" / "pride_and_prejudice_ch1.txt",
         ROOT / "tpserve" / "model" / "data" / "kv_calibration.txt")


def scene(ids: list[int], long: int, short: int, shorts: int
          ) -> tuple[list[list[int]], list[list[int]]]:
    """Two long prompts and ``shorts`` short ones, each a different slice of ``ids``
    (repeated as needed; the prefix cache is off, so no slice finds another's blocks)."""
    need = 2 * long + shorts * short
    ids = ids * (need // len(ids) + 1)
    longs = [ids[i * long:(i + 1) * long] for i in range(2)]
    base = 2 * long
    return longs, [ids[base + i * short:base + (i + 1) * short] for i in range(shorts)]


def run(runner: ModelRunner, tokenizer: Any, sched: SchedulerConfig, longs: list[list[int]],
        shorts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    core = EngineCore(runner, tokenizer, sched, EngineConfig())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, tuple[int, float]] = {}
    arrival: dict[str, float] = {}
    steps = 0

    def add(rid: str, prompt: list[int]) -> None:
        def emit(out: Any) -> None:
            if isinstance(out, BaseException):
                raise out
            if rid not in first and any(d.token_ids for d in out.deltas):
                first[rid] = (steps, time.monotonic() - arrival[rid])

        arrival[rid] = time.monotonic()
        core.add(RequestState(rid, prompt, params, emit))

    t0 = time.monotonic()
    for i, prompt in enumerate(longs):
        add(f"long{i}", prompt)
    core.step()
    steps += 1
    for i, prompt in enumerate(shorts):
        add(f"short{i}", prompt)
    while core.has_unfinished:
        core.step()
        steps += 1
    seconds = time.monotonic() - t0
    short_ttft = [first[f"short{i}"][1] for i in range(len(shorts))]
    return {
        "steps": steps, "seconds": round(seconds, 3),
        "first_token": {rid: {"step": s, "seconds": round(t, 3)}
                        for rid, (s, t) in sorted(first.items())},
        "short_ttft_mean_s": round(sum(short_ttft) / len(short_ttft), 3),
        "short_ttft_max_s": round(max(short_ttft), 3),
        "long_ttft_s": [round(first[f"long{i}"][1], 3) for i in range(len(longs))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--long", type=int, default=1536, help="tokens of each long prompt")
    p.add_argument("--short", type=int, default=24, help="tokens of each short prompt")
    p.add_argument("--shorts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--threshold", type=int, default=256,
                   help="--long-prefill-token-threshold of the threshold and seats runs")
    p.add_argument("--seats", type=int, default=4, help="--max-num-partial-prefills")
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--warmup", action="store_true",
                   help="one unrecorded run of every configuration first (kernel compiles)")
    a = p.parse_args()

    torch.manual_seed(0)
    argv = ["serve", "--device", a.device, "--max-num-seqs", "16", "--max-num-batched-tokens",
            str(a.budget), "--max-model-len", str(a.max_model_len), "--block-size", "16",
            "--no-enable-prefix-caching", "--kv-cache-memory", a.kv_cache_memory]
    if a.model is not None:
        argv += ["--model", a.model, "--load-format", a.load_format]
    cfg = config_from_args(build_parser()[0].parse_args(argv))
    ckpt = open_checkpoint(cfg.runner.model, cfg.runner.load_format)
    tokenizer = ckpt.tokenizer()
    ids = tokenizer("\n\n".join(t.read_text() for t in TEXTS))["input_ids"]
    longs, shorts = scene(ids, a.long, a.short, a.shorts)
    configs = {
        "default": {},
        "threshold": {"long_prefill_token_threshold": a.threshold},
        "seats": {"long_prefill_token_threshold": a.threshold, "max_num_partial_prefills": a.seats,
                  "max_long_partial_prefills": 1},
    }
    base = cfg.scheduler
    device = torch.device(cfg.runner.device)
    runner = ModelRunner(cfg.runner, base.limits, TPGroup(0, 1, device, None))
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "git_commit": a.git_commit,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads)",
        "dtype": cfg.runner.dtype, "kernels": runner.ops.name,
        "model": ckpt.description, "scene": {
            "long_prompts": [len(x) for x in longs], "short_prompts": [len(x) for x in shorts],
            "max_tokens": a.max_tokens, "max_num_batched_tokens": a.budget},
        "configs": {name: {"flags": cfg, "runs": []} for name, cfg in configs.items()},
    }
    if a.warmup:
        for fields in configs.values():
            run(runner, tokenizer, SchedulerConfig(**{**vars(base), **fields}), longs, shorts,
                a.max_tokens)
    for _ in range(a.repeats):
        for name, fields in configs.items():
            sched = SchedulerConfig(**{**vars(base), **fields})
            results["configs"][name]["runs"].append(
                run(runner, tokenizer, sched, longs, shorts, a.max_tokens))
            Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, entry in results["configs"].items():
        for r in entry["runs"]:
            print(f"{name:9s} short TTFT mean {r['short_ttft_mean_s']:.2f} s, max "
                  f"{r['short_ttft_max_s']:.2f} s; long TTFT {r['long_ttft_s']} s; "
                  f"{r['steps']} steps, {r['seconds']:.2f} s")


if __name__ == "__main__":
    main()
