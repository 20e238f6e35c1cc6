"""Decode attention at batch 1 and 64 for several split counts (the split heuristic's
inputs), timed on the GPU with CUDA graphs of 32 launches (one per layer); with
``--dtype float32``, float32 launches (``FP32_LAUNCHES``) instead.

    python bench/tune_decode.py --out results/decode-splits.json [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.model.kernels.decode_launch import (  # noqa: E402
    SPLIT_FIELDS,
    decode_num_splits,
    default_launch,
    default_num_splits,
)
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402


def time_graph(fn, reps: int = 20) -> float:
    """Median microseconds of one ``fn`` call, replayed from a graph of 32 calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 32)
    return sorted(times)[len(times) // 2]


def time_against(fn, out: torch.Tensor, reference: torch.Tensor | None, reps: int = 20
                 ) -> tuple[float, float, torch.Tensor]:
    """``(us, max_abs_diff, reference)``: ``fn``'s median microseconds (``time_graph``) and
    the largest difference of what it wrote into ``out`` from ``reference`` (None: this
    launch is the reference, its output kept)."""
    us = time_graph(fn, reps)
    if reference is None:
        reference = out.clone()
    return us, (out - reference).abs().max().item(), reference


def launch_knobs(launch) -> dict:
    """A ``DecodeLaunch`` as ``decode_attention``'s tile keywords: every field but those
    that only choose the split count (``SPLIT_FIELDS``)."""
    return {k: v for k, v in launch._asdict().items() if k not in SPLIT_FIELDS}


def scattered_block_table(nblk: list[int], rows: int | None = None,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """An int32 block table ``[rows, max(nblk)]`` (host; ``rows`` defaults to
    ``len(nblk)``): sequence ``i`` owns ``nblk[i]`` blocks of one random permutation of
    ``sum(nblk)`` blocks, in order; entries past a sequence's blocks and rows past
    ``len(nblk)`` are 0."""
    perm = torch.randperm(sum(nblk), generator=generator).int()
    table = torch.zeros(len(nblk) if rows is None else rows, max(nblk), dtype=torch.int32)
    first = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[first:first + nb]
        first += nb
    return table


def write_rows(path: str, rows: list[dict]) -> None:
    """The sweep's rows with the commit, device and versions they were measured with."""
    meta = {"git_commit": git_commit(None)[0], "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    Path(path).write_text(json.dumps(meta, indent=1) + "\n")


# (block_n, warps, stages, fma) for a float32 cache. Round 37 timed six dot launches at the
# bf16 launch's split count (the 64-key, 4-warp one spills 616 bytes a thread on sm_90,
# compiled offline; 16x4x3, 32x8x2, 16x2x3 and 16x1x3 spill none); round 38 adds the FMA
# form and the split count
FP32_LAUNCHES = [(64, 4, 3, False), (16, 1, 3, False), (16, 4, 3, True), (16, 2, 3, True),
                 (32, 4, 2, True), (8, 1, 3, True)]
# (batch, context, q heads, split counts); 8 KV heads of 128
FP32_SHAPES = [(1, 600, 16, (4, 16, 32)), (1, 2000, 16, (8, 32)), (8, 600, 16, (4, 16)),
               (64, 1152, 16, (1, 2)), (1, 600, 32, (8, 32)), (64, 1152, 32, (1, 2))]


def float32_sweep(path: str) -> None:
    """``FP32_LAUNCHES`` x split counts over float32 q and cache (``FP32_SHAPES``), each
    launch's max |difference| from the default's output (the first row of a shape: the
    default launch at its default split count, for a graph over 1,024 keys)."""
    dev = torch.device("cuda")
    hkv, d, page = 8, 128, 16
    rows = []
    for batch, ctx, hq, split_counts in FP32_SHAPES:
        per_seq = -(-ctx // page)
        kc = torch.randn(batch * per_seq, page, hkv, d, device=dev)
        vc = torch.randn_like(kc)
        tables = torch.randperm(batch * per_seq, device=dev).int().view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * ctx * hkv * d * 4
        shipped = default_launch(kc.dtype, batch, hkv)
        runs = [("default", default_num_splits(kc.dtype, batch, hkv, 1024),
                 launch_knobs(shipped))]
        runs += [(f"{bn}x{w}x{st}{' fma' if fma else ''}", n,
                  dict(block_n=bn, num_warps=w, num_stages=st, fma=fma))
                 for bn, w, st, fma in FP32_LAUNCHES for n in split_counts]
        reference, shape_rows = None, []
        for name, splits, kw in runs:
            args = (q, kc, vc, tables, lens, 0.088, out, splits)
            us, diff, reference = time_against(
                lambda args=args, kw=kw: decode_attention(*args, **kw), out, reference, 10)
            row = {"batch": batch, "context": ctx, "q_heads": hq, "launch": name,
                   "splits": splits, "us": round(us, 2), "kv_TBps": round(kv_bytes / us / 1e6, 3),
                   "max_abs_diff": diff}
            shape_rows.append(row)
            print(row, flush=True)
        best = sorted(shape_rows[1:], key=lambda r: r["us"])[:3]
        print(f"batch {batch} x {ctx}, {hq} q heads: default {shape_rows[0]['us']} us; best "
              + ", ".join(f"{r['launch']} /{r['splits']} {r['us']}" for r in best), flush=True)
        rows += shape_rows
        write_rows(path, rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="float32: FP32_LAUNCHES over a float32 cache instead")
    a = p.parse_args()
    if a.dtype == "float32":
        return float32_sweep(a.out)
    dev = torch.device("cuda")
    hq, hkv, d, page, blocks_per_seq = 32, 8, 128, 16, 128
    rows = []
    for batch, ctx in ((1, 1152), (1, 2000), (64, 1152)):
        nb = batch * blocks_per_seq
        kc = torch.randn(nb, page, hkv, d, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, device=dev, dtype=torch.int64).int().view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        for splits in (1, 2, 4, 8, 16, 32):
            args = (q, kc, vc, tables, lens, 0.088, out, splits)
            us = time_graph(lambda args=args: decode_attention(*args))
            rows.append({"batch": batch, "context": ctx, "splits": splits, "us": round(us, 2),
                         "kv_TBps": round(kv_bytes / us / 1e6, 3),
                         "heuristic": decode_num_splits(batch, hkv, 2048) == splits})
            print(rows[-1], flush=True)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
