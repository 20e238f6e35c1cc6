"""Tensor parallelism across GPUs (issue 7): correctness of tp N against tp 1 and the
latency and bus bandwidth of the collectives, one run per size, one JSON.

    python bench/bench_tp.py --tp 1 2 4 --tp-comm allreduce allgather \
        --out results/h200x4-DATE-tp.json                                      # GPUs, NCCL
    python bench/bench_tp.py --small --device cpu --tp 1 2 --dtype float32 \
        --tp-comm allreduce allgather --out /tmp/tp.json                       # logic check

- ``correctness``: the same dummy weights at every tp (they are a hash of seed, name and
  index, read per shard), the same prompts, in each ``--tp-comm`` mode (tp 1 is the
  reference; both modes are the same there). It records the logits of the last prompt
  position against tp 1 (max abs difference, and relative to the logits' spread), then
  greedy steps. The greedy tokens are compared with tp 1's; at the first divergence the
  tp 1 top-2 margin of that step is recorded, since random weights give near-ties that
  bf16 rounding may flip. ``--dtype float32`` for a correctness comparison (bf16 is the
  default, what serving runs).
- ``collectives``: all-reduce, all-gather and reduce-scatter from 8 KiB (a batch-1 hidden
  state of an 8B model in bf16) to 256 MiB: latency per call in microseconds, algorithm
  bandwidth and bus bandwidth (NCCL's definition: size / time x 2(n-1)/n for all-reduce,
  x (n-1)/n for all-gather and reduce-scatter; size is the full tensor: the all-reduce
  buffer, the all-gather output, the reduce-scatter input). Timed with CUDA events (wall
  clock on CPU) over a batch of back-to-back calls; the median of 10 batches after 3
  warm-ups.

The engine's throughput at each tp comes from ``bench_engine.py --tensor-parallel-size N``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.model.attention.backend import select_attention  # noqa: E402
from tpserve.model.kernels.backend import resolve_kernel_backend, select_ops  # noqa: E402
from tpserve.model.kv_pool import KVPool  # noqa: E402
from tpserve.model.loader.build import build_model  # noqa: E402
from tpserve.model.loader.checkpoint import open_checkpoint  # noqa: E402
from tpserve.model.plan import SeqChunk, StepPlan  # noqa: E402
from tpserve.parallel.comm import TP_COMM_MODES, Communicator  # noqa: E402
from tpserve.parallel.launch import run_ranks  # noqa: E402


def _greedy(group, shape: str, dtype: str, prompts: list[list[int]], steps: int,
            tp_comm: str):
    """On every rank: prefill the prompts, then ``steps`` greedy decodes of all of them;
    returns (last-position logits of the prefill [P, V] float32, tokens [P, steps], the
    top-2 margin of the logits each token was chosen from [P, steps])."""
    comm = Communicator(group)
    device = group.device
    dt = getattr(torch, dtype)
    ckpt = open_checkpoint(shape, "dummy", 0)
    backend = resolve_kernel_backend("auto", device.type)
    attn = select_attention(backend, dt)
    model = build_model(ckpt, comm, device, dt, select_ops(backend), attn, 4096,
                        tp_comm=tp_comm)
    cfg = ckpt.config
    bs = 16
    per_seq = -(-(max(map(len, prompts)) + steps) // bs)
    pool = KVPool(cfg.num_hidden_layers, per_seq * len(prompts), bs,
                  cfg.kv_heads_for(comm.world_size), cfg.head_dim, dt, device)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]

    def step(chunks):
        plan = StepPlan.build(chunks, bs, attn).to(device)
        with torch.inference_mode():
            hidden = model(plan.input_ids, plan.positions, pool.layers, plan.metadata(attn))
            return model.compute_logits(hidden[plan.logits_indices]).float()

    logits = step([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    first = logits.cpu()
    tokens, margins, lens = [], [], [len(p) for p in prompts]
    for _ in range(steps):
        top2 = logits.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        logits = step([SeqChunk([t], n, tab, True)
                       for t, n, tab in zip(nxt, lens, tables, strict=True)])
        lens = [n + 1 for n in lens]
    return first, torch.tensor(tokens).T.contiguous(), torch.tensor(margins).T.contiguous()


# op -> bus bandwidth factor over n ranks (NCCL's definitions)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


def _size_name(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


def _collectives(group, sizes: list[int], dtype: str):
    """Latency and bandwidth of each collective at each size (bytes of the full tensor)."""
    comm = Communicator(group)
    device, n = group.device, group.world_size
    dt = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    sync = torch.zeros(1, device=device)
    rows = []
    for nbytes in sizes:
        numel = nbytes // itemsize // n * n  # divisible into n equal shards
        full = torch.ones(numel, dtype=dt, device=device)
        shard = torch.ones(numel // n, dtype=dt, device=device)
        ops = {"all_reduce": lambda f=full: comm.all_reduce(f),
               "all_gather": lambda s=shard: comm.all_gather(s, dim=0),
               "reduce_scatter": lambda f=full: comm.reduce_scatter(f)}
        reps = max(1, min(100, 2**24 // nbytes))  # small messages: time a batch of calls
        for op, fn in ops.items():
            times = []
            for i in range(13):
                comm.all_reduce(sync)  # start together
                if device.type == "cuda":
                    a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    a.record()
                    for _ in range(reps):
                        fn()
                    b.record()
                    b.synchronize()
                    t = a.elapsed_time(b) / 1e3 / reps
                else:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    t = (time.perf_counter() - t0) / reps
                if i >= 3:
                    times.append(t)
            t = statistics.median(times)
            size = numel * itemsize
            rows.append({"op": op, "bytes": size, "size": _size_name(nbytes),
                         "us": round(t * 1e6, 2), "calls_per_sample": reps,
                         "alg_GBps": round(size / t / 1e9, 3),
                         "bus_GBps": round(size * BUS_FACTOR[op](n) / t / 1e9, 3)})
    return rows


def _compare(ref, first, tokens) -> dict:
    """tp N against tp 1: logits at the last prompt position, greedy tokens, and at each
    prompt's first divergence the tp 1 top-2 margin of that step."""
    ref_first, ref_tokens, ref_margins = ref
    diff = (first - ref_first).abs().max().item()
    spread = ref_first.std().item()
    same = tokens == ref_tokens
    rec = {"logits_max_abs_diff": float(f"{diff:.3g}"),
           "logits_diff_over_std": float(f"{diff / spread:.3g}"),
           "greedy_equal_per_prompt": same.all(dim=1).tolist(),
           "greedy_steps_equal": same.long().cumprod(dim=1).sum(dim=1).tolist()}
    for i, ok in enumerate(rec["greedy_equal_per_prompt"]):
        if not ok:
            step = rec["greedy_steps_equal"][i]
            rec.setdefault("first_divergence", []).append(
                {"prompt": i, "step": step, "tp1_token": int(ref_tokens[i, step]),
                 "token": int(tokens[i, step]),
                 "tp1_top2_margin": round(float(ref_margins[i, step]), 6),
                 "tp1_margin_over_std": round(float(ref_margins[i, step]) / spread, 6)})
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tp-comm", nargs="+", default=["allreduce"],
                   choices=list(TP_COMM_MODES), help="communication mode(s) to compare")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model and collective dtype (float32 for correctness comparisons)")
    p.add_argument("--small", action="store_true",
                   help="SmolLM2 shape, 4 steps, collectives up to 4 MiB")
    p.add_argument("--shape", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--git-commit", default=None)
    a = p.parse_args()
    shape = a.shape or ("smollm2-135m" if a.small else "llama3-8b")
    steps = a.steps or (4 if a.small else 64)
    prompts = [[(7 * i + 13 * j) % 30000 + 1 for j in range(n)]
               for i, n in enumerate((17, 100, 333, 1000))]
    sizes = ([8 * 2**10, 64 * 2**10, 2**20, 4 * 2**20] if a.small else
             [8 * 2**10 * 4**k for k in range(8)] + [256 * 2**20])  # 8 KiB .. 128 MiB, 256
    R = {"git_commit": git_commit(a.git_commit)[0], "shape": shape, "dtype": a.dtype,
         "tp_comm": a.tp_comm,
         "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
         "torch": torch.__version__, "steps": steps, "correctness": {}, "collectives": {}}
    out = Path(a.out)
    ref = None
    tps = sorted(set(a.tp) | {1})  # tp 1 is the reference
    for tp in tps:
        for mode in a.tp_comm if tp > 1 else ["allreduce"]:
            t0 = time.perf_counter()
            first, tokens, margins = run_ranks(_greedy, tp, shape, a.dtype, prompts, steps,
                                               mode, timeout_s=900, device=a.device)[0]
            rec = {"seconds": round(time.perf_counter() - t0, 1)}
            if ref is None:
                ref = (first, tokens, margins)
                rec["tp1_min_top2_margin"] = round(margins.min().item(), 6)
            else:
                rec.update(_compare(ref, first, tokens))
            R["correctness"][f"tp{tp}" if tp == 1 else f"tp{tp}-{mode}"] = rec
            out.write_text(json.dumps(R, indent=1) + "\n")
            print(f"tp {tp} {mode}: {rec}", flush=True)
        if tp > 1:
            R["collectives"][str(tp)] = run_ranks(_collectives, tp, sizes, a.dtype,
                                                  timeout_s=600, device=a.device)[0]
            out.write_text(json.dumps(R, indent=1) + "\n")
    for tp, rows in R["collectives"].items():
        for r in rows:
            print(f"tp {tp} {r['op']:>14} {r['size']:>8}: {r['us']:>10.1f} us "
                  f"{r['bus_GBps']:>8.2f} GB/s bus")


if __name__ == "__main__":
    main()
