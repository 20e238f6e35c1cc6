"""Tensor parallelism across GPUs (issue 7): correctness of tp N against tp 1 and the bus
bandwidth of the collectives, one run per size, one JSON.

    python bench/bench_tp.py --tp 1 2 4 --out results/h200x4-DATE-tp.json      # GPUs, NCCL
    python bench/bench_tp.py --small --device cpu --tp 1 3 --out /tmp/tp.json   # logic check

- ``correctness``: the same dummy weights at every tp (they are a hash of seed, name and
  index, read per shard), the same prompts. It records the logits of the last prompt
  position against tp 1 (max abs difference, and relative to the logits' spread), then 64
  greedy steps. The greedy tokens are compared with tp 1's; at the first divergence the
  tp 1 top-2 margin is recorded, since random weights give near-ties that bf16 rounding
  may flip.
- ``collectives``: all-reduce and all-gather bus bandwidth (NCCL's definition: algorithm
  bandwidth x 2(n-1)/n and x (n-1)/n) at message sizes from 1 MiB to 256 MiB, timed
  with CUDA events (wall clock on CPU), the median of 10 after 3 warm-ups.

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
from tpserve.parallel.comm import Communicator  # noqa: E402
from tpserve.parallel.launch import run_ranks  # noqa: E402


def _greedy(group, shape: str, dtype: str, prompts: list[list[int]], steps: int):
    """On every rank: prefill the prompts, then ``steps`` greedy decodes of all of them;
    returns (last-position logits of the prefill [P, V] float32, tokens [P, steps])."""
    comm = Communicator(group)
    device = group.device
    dt = getattr(torch, dtype)
    ckpt = open_checkpoint(shape, "dummy", 0)
    backend = resolve_kernel_backend("auto", device.type)
    attn = select_attention(backend, dt)
    model = build_model(ckpt, comm, device, dt, select_ops(backend), attn, 4096)
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
    tokens, lens = [], [len(p) for p in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        logits = step([SeqChunk([t], n, tab, True)
                       for t, n, tab in zip(nxt, lens, tables, strict=True)])
        lens = [n + 1 for n in lens]
    return first, torch.tensor(tokens).T.contiguous()


def _collectives(group, sizes_mib: list[int]):
    comm = Communicator(group)
    device, n = group.device, group.world_size
    rows = []
    for mib in sizes_mib:
        numel = mib * 2**20 // 2
        x = torch.ones(numel, dtype=torch.bfloat16, device=device)
        shard = torch.ones(numel // n, dtype=torch.bfloat16, device=device)
        for op, fn, factor in (
                ("all_reduce", lambda x=x: comm.all_reduce(x), 2 * (n - 1) / n),
                ("all_gather", lambda s=shard: comm.all_gather(s, dim=0), (n - 1) / n)):
            times = []
            for i in range(13):
                if device.type == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    t = a.elapsed_time(b) / 1e3
                else:
                    t0 = time.perf_counter()
                    fn()
                    t = time.perf_counter() - t0
                if i >= 3:
                    times.append(t)
            t = statistics.median(times)
            rows.append({"op": op, "mib": mib, "ms": round(t * 1e3, 4),
                         "bus_GBps": round(mib * 2**20 * factor / t / 1e9, 2)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="SmolLM2 shape, fp32, 4 steps")
    p.add_argument("--shape", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--git-commit", default=None)
    a = p.parse_args()
    shape = a.shape or ("smollm2-135m" if a.small else "llama3-8b")
    steps = a.steps or (4 if a.small else 64)
    dtype = "float32" if a.device == "cpu" else "bfloat16"
    prompts = [[(7 * i + 13 * j) % 30000 + 1 for j in range(n)]
               for i, n in enumerate((17, 100, 333, 1000))]
    sizes = [1, 4] if a.small else [1, 4, 16, 64, 256]
    R = {"git_commit": git_commit(a.git_commit)[0], "shape": shape, "dtype": dtype,
         "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
         "torch": torch.__version__, "steps": steps, "correctness": {}, "collectives": {}}
    out = Path(a.out)
    ref = None
    for tp in a.tp:
        t0 = time.perf_counter()
        first, tokens = run_ranks(_greedy, tp, shape, dtype, prompts, steps,
                                  timeout_s=900, device=a.device)[0]
        rec = {"seconds": round(time.perf_counter() - t0, 1)}
        if ref is None:
            ref = (first, tokens)
        else:
            diff = (first - ref[0]).abs().max().item()
            spread = ref[0].std().item()
            same = (tokens == ref[1])
            rec.update({"logits_max_abs_diff": round(diff, 5),
                        "logits_diff_over_std": round(diff / spread, 4),
                        "greedy_equal_per_prompt": same.all(dim=1).tolist(),
                        "greedy_steps_equal": same.long().cumprod(dim=1).sum(dim=1).tolist()})
            for i, ok in enumerate(rec["greedy_equal_per_prompt"]):
                if not ok:
                    step = rec["greedy_steps_equal"][i]
                    rec.setdefault("first_divergence", []).append(
                        {"prompt": i, "step": step, "tp1_token": int(ref[1][i, step]),
                         "token": int(tokens[i, step])})
        R["correctness"][str(tp)] = rec
        if tp > 1:
            R["collectives"][str(tp)] = run_ranks(_collectives, tp, sizes, timeout_s=600,
                                                  device=a.device)[0]
        out.write_text(json.dumps(R, indent=1) + "\n")
        print(f"tp {tp}: {rec}", flush=True)
    print(json.dumps(R["collectives"], indent=1))


if __name__ == "__main__":
    main()
