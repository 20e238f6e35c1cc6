"""The prefix cache with and without its host tier (``--kv-offloading-size``), in the engine.

Workload: ``--docs`` documents of ``--doc-len`` random tokens, each asked a question
(``--question-len`` tokens, ``--output-len`` greedy tokens back) in ``--rounds`` rounds, the
documents in the same order each round, ``--concurrency`` requests in flight (with
``--stagger`` their output lengths vary, so they finish and are replaced one by one while
others decode, as on a server). The documents
together are larger than the device pool (``--kv-cache-memory``), so without the tier a
document's blocks are evicted before it comes back; with it they are loaded back.

For each ``--offload`` size (GiB; 0: no tier) one engine is built and measured: per round
the wall time, TTFT and inter-token latency (mean, p50, p99), the ``step()`` calls' times
by the copies listed in them, prefix-cache hits and the tier's copies. With a tier, first
the copies themselves: ``--copy-blocks`` blocks of the live pool stored and loaded back
(bit-for-bit check, GB/s each way). Every run's last-round tokens are compared with the first run's (requests whose
tokens are all the same, and whose first token is).

    python bench/bench_offload.py --out "$OUT/offload.json"   # on the GPU machine
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_sections import StubTokenizer, Tracker, ms_stats  # noqa: E402

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.model.sampling_params import SamplingParams  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.request_state import RequestState  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / ".benchdata" / "llama3-8b"))
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="8GiB")
    p.add_argument("--offload", default="0,40", help="tier sizes in GiB, comma-separated")
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--doc-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stagger", action="store_true",
                   help="each request's output length drawn (seeded) from output-len/2 .. "
                        "3*output-len/2, so requests finish and are replaced one by one, "
                        "while others decode (as a server's do), not in waves")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--copy-blocks", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--git-commit", default="")
    p.add_argument("--out", required=True)
    return p.parse_args()


def build(a: argparse.Namespace, gib: float) -> EngineCore:
    argv = ["serve", a.model, "--load-format", a.load_format, "--dtype", a.dtype,
            "--device", a.device, "--kv-cache-memory", a.kv_cache_memory,
            "--max-model-len", str(a.doc_len + a.question_len + a.output_len + 16),
            "--max-num-seqs", str(a.concurrency),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--kv-offloading-size", str(gib)]
    parser, _ = build_parser()
    cfg = config_from_args(parser.parse_args(argv))
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, TPGroup(0, 1, device, None))
    return EngineCore(runner, StubTokenizer(), cfg.scheduler, cfg.engine)


def sync(core: EngineCore) -> None:
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize(core.runner.device)


def copy_check(core: EngineCore, n: int) -> dict:
    """Stores ``n`` random pool blocks and loads them back into other blocks: bit-for-bit
    equal, and the rate each way (the pool's content is whatever it holds: any bits)."""
    host, pool = core.runner.host_kv, core.runner.kv_pool
    n = min(n, host.num_slots, pool.num_blocks // 2)
    rng = random.Random(0)
    src = rng.sample(range(pool.num_blocks), 2 * n)
    src, dst = src[:n], src[n:]
    raw = pool.buffer.view(torch.uint8)
    raw[:, :, src].random_(0, 256)
    slots = list(range(n))
    sync(core)
    t0 = time.perf_counter()
    host.store(src, slots)
    sync(core)
    t1 = time.perf_counter()
    host.load(slots, dst, -1)  # a batch of its own, before the engine's first (0)
    host.join(-1)
    sync(core)
    t2 = time.perf_counter()
    same = bool(torch.equal(raw[:, :, src], raw[:, :, dst]))
    nbytes = n * host.bytes_per_block
    return {"blocks": n, "bytes": nbytes, "bit_for_bit": same,
            "store_s": round(t1 - t0, 5), "load_s": round(t2 - t1, 5),
            "store_GBps": round(nbytes / (t1 - t0) / 1e9, 2),
            "load_GBps": round(nbytes / (t2 - t1) / 1e9, 2)}


def step_summary(steps: list[tuple[float, int, int]]) -> dict:
    """``core.step()`` call times by the copies of that call or the one before (a step's
    copies are issued in the call that schedules it; with asynchronous scheduling the
    next call waits for that step): stores, loads, both or neither; and the ten slowest
    calls, ``[ms, stores, loads, stores before, loads before]``."""
    kinds = {"neither": [], "stores": [], "loads": [], "both": []}
    rows = [(dt, st, ld, *prev[1:]) for prev, (dt, st, ld)
            in zip([(0, 0, 0), *steps], steps, strict=False)]
    for dt, st, ld, pst, pld in rows:
        kinds[("neither", "stores", "loads", "both")[(st + pst > 0)
                                                     + 2 * (ld + pld > 0)]].append(dt)
    out = {k: {"calls": len(v), **ms_stats(v)} for k, v in kinds.items()}
    out["slowest"] = [[round(r[0] * 1e3, 2), *r[1:]] for r in sorted(rows, reverse=True)[:10]]
    return out


def run_round(core: EngineCore, a: argparse.Namespace, docs: list[list[int]], r: int,
              vocab: int) -> dict:
    rng = random.Random(1000 + r)
    queue = [(f"r{r}d{i}", d + [rng.randrange(vocab) for _ in range(a.question_len)],
              SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(
                  a.output_len // 2, 3 * a.output_len // 2) if a.stagger else a.output_len))
             for i, d in enumerate(docs)]
    before = dict(core.stats())
    trackers: list[Tracker] = []
    live: list[Tracker] = []
    steps: list[tuple[float, int, int]] = []  # a step call's seconds, its stores and loads
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < a.concurrency:
            rid, prompt, params = queue.pop(0)
            t = Tracker(rid)
            core.add(RequestState(rid, prompt, params, t.emit))
            trackers.append(t)
            live.append(t)
        c0 = core.stats()
        s0 = time.perf_counter()
        core.step()
        c1 = core.stats()
        steps.append((time.perf_counter() - s0, *(
            c1.get(k, 0) - c0.get(k, 0) for k in ("kv_offload_stored_blocks_total",
                                                    "kv_offload_loaded_blocks_total"))))
        live = [t for t in live if not t.finished]
    sync(core)
    wall = time.perf_counter() - t0
    after = core.stats()
    errors = [t.error for t in trackers if t.error]
    ttft = [t.token_times[0] - t.t_add for t in trackers if t.token_times]
    delta = {k: after[k] - before.get(k, 0) for k in (
        "prefix_cache_queries_total", "prefix_cache_hits_total", "steps_total",
        "num_preemptions_total", "kv_offload_stored_blocks_total",
        "kv_offload_loaded_blocks_total", "step_host_seconds_total",
        "device_wait_seconds_total") if k in after}
    return {"round": r, "wall_s": round(wall, 3), "requests": len(trackers),
            "errors": errors[:3], "ttft_ms": ms_stats(ttft),
            "itl_ms": ms_stats([b - a for t in trackers
                                for a, b in itertools.pairwise(t.token_times)]),
            "step_call_ms": step_summary(steps),
            "tokens": {t.rid: t.tokens for t in trackers},
            "prompt_tok_per_s": round(sum(len(d) + a.question_len for d in docs) / wall, 1),
            "output_tokens": sum(len(t.tokens) for t in trackers),
            **delta}


def main() -> int:
    a = parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    R: dict = {"git_commit": a.git_commit,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
               "torch": torch.__version__, "args": vars(a), "runs": []}
    reference: dict | None = None
    for spec in a.offload.split(","):
        gib = float(spec)
        core = build(a, gib)
        run: dict = {"offload_gib": gib, "kv_pool_blocks": core.block_manager.num_blocks,
                     "host_blocks": core.block_manager.host.num_slots
                     if core.block_manager.host else 0,
                     "memory_plan": core.runner.plan.describe()}
        vocab = core.runner.model_config.vocab_size
        rng = random.Random(7)
        docs = [[rng.randrange(vocab) for _ in range(a.doc_len)] for _ in range(a.docs)]
        if core.runner.host_kv is not None:
            run["copies"] = copy_check(core, a.copy_blocks)
            print("copies", run["copies"], flush=True)
        warm = RequestState("warm", [rng.randrange(vocab) for _ in range(64)],
                            SamplingParams(max_tokens=4), lambda o: None)
        core.add(warm)
        while core.has_unfinished:
            core.step()
        run["rounds"] = []
        for r in range(a.rounds):
            res = run_round(core, a, docs, r, vocab)
            tokens = res.pop("tokens")
            run["rounds"].append(res)
            print(f"offload {spec} GiB round {r}: {res}", flush=True)
        if reference is None:
            reference = tokens
        else:
            run["last_round_vs_first_run"] = {
                "requests": len(tokens),
                "all_tokens_same": sum(tokens[k] == reference[k] for k in tokens),
                "first_token_same": sum(tokens[k][:1] == reference[k][:1] for k in tokens)}
            print("vs the first run:", run["last_round_vs_first_run"], flush=True)
        R["runs"].append(run)
        out.write_text(json.dumps(R, indent=1))
        core.close()
        del core
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
