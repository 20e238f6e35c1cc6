"""Which allocation created each allocator segment of a serving run (GPU).

Runs the engine benchmark's temperature-1.0 serving workload (dummy Llama-3-8B through
``EngineCore``, closed loop at ``--concurrency``, the same warm-up as ``bench_engine.py``),
turns on ``torch.cuda.memory._record_memory_history`` after the warm-up, and afterwards
prints, for every segment created during the serving run (``segment_alloc`` events of the
recorded trace), its pool, size, the step's batch at the time when known, and the Python
stack of the allocation that created it. Writes JSON to ``--out``.

    python3 bench/segments_probe.py --out "$OUT/segments-probe.json" --git-commit SHA

Recording stacks slows every allocation, so the run's throughput is not a figure here;
``--num-prompts`` keeps it short. ``--skip-sampler-warmup`` builds the engine as before
issue 16 (no ``Sampler.warm_up``), to see the segments it left.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from alloc_trace import created_segments  # noqa: E402
from engine_sections import StubTokenizer, random_prompt, run_closed_loop  # noqa: E402

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.memory import start_memory_history  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.model.sampler import Sampler  # noqa: E402
from tpserve.parallel.state import TPGroup, pick_device  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--warmup-output-len", type=int, default=16)
    p.add_argument("--frames", type=int, default=40)
    p.add_argument("--skip-sampler-warmup", action="store_true")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--kv-cache-dtype", default="auto")
    a = p.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = pick_device(0, "auto")
    argv = ["serve", a.model, "--load-format", "dummy", "--dtype", "bfloat16",
            "--device", device.type, "--max-model-len", "2048", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.9",
            "--quantization", a.quantization, "--kv-cache-dtype", a.kv_cache_dtype]
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(argv))
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, TPGroup(0, 1, device, None))
    warm_up = Sampler.warm_up
    if a.skip_sampler_warmup:
        Sampler.warm_up = lambda self, vocab, rows: None  # the engine as before issue 16
    try:
        core = EngineCore(runner, StubTokenizer(), cfg.scheduler, cfg.engine)
    finally:
        Sampler.warm_up = warm_up
    vocab = runner.model_config.vocab_size
    rng = random.Random(0)
    # the bench's warm-up (greedy, as bench_engine.py), then a batch-1 decode like its
    # decode section
    run_closed_loop(core, [random_prompt(rng, a.input_len, vocab)
                           for _ in range(a.warmup_prompts)], a.warmup_output_len,
                    a.concurrency, None, None, "warm")
    run_closed_loop(core, [random_prompt(rng, a.input_len, vocab)], 64, 1, None, None, "b1")
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_stats(device)
    start_memory_history(device, 2_000_000)
    batch_sizes: list[int] = []
    step = core.step

    def counted_step() -> None:  # the batch each step samples, to date the segments
        batch_sizes.append(len(core.scheduler.running))
        step()

    core.step = counted_step
    t0 = time.perf_counter()
    done, wall, steps = run_closed_loop(
        core, [random_prompt(rng, a.input_len, vocab) for _ in range(a.num_prompts)],
        a.output_len, a.concurrency, None, None, "srv", a.temperature)
    torch.cuda.synchronize(device)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    after = torch.cuda.memory_stats(device)
    created, freed, events = created_segments(snap, a.frames)
    R = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
         "git_commit": a.git_commit, "torch": torch.__version__,
         "device": torch.cuda.get_device_name(device), "config": vars(a),
         "serving": {"requests": len(done), "steps": steps, "wall_s": round(wall, 2),
                     "recorded_s": round(time.perf_counter() - t0, 2),
                     "batch_min": min(batch_sizes, default=None),
                     "steps_with_at_most_2_running": sum(b <= 2 for b in batch_sizes)},
         "new_segments": after["segment.all.allocated"] - before["segment.all.allocated"],
         "segment_current_delta": (after["segment.all.current"]
                                   - before["segment.all.current"]),
         "segments_freed_in_trace": freed, "trace_events": events,
         "created": created}
    out.write_text(json.dumps(R, indent=1) + "\n")
    print(json.dumps({k: R[k] for k in ("new_segments", "segment_current_delta", "serving")},
                     indent=1))
    for c in created:
        print(f"\nsegment {c['address']:#x}: {c['size']} bytes ({c['pool']}), first "
              f"allocation {c['first_alloc_size']} bytes; created at:")
        for line in c["stack"]:
            print("   ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
