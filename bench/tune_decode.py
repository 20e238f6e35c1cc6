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

from tpserve.model.kernels.triton_decode_attention import (  # noqa: E402
    decode_attention,
    decode_num_splits,
)


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
    """A ``DecodeLaunch`` as ``decode_attention``'s tile keywords: every field but
    ``target_programs``, which only chooses the split count (``decode_num_splits``)."""
    knobs = launch._asdict()
    del knobs["target_programs"]
    return knobs


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


# (block_n, warps, stages) for a float32 cache (round 37: the shipped 64-key, 4-warp launch
# spills 616 bytes a thread on sm_90, compiled offline; these four spill none, 32 x 4 x 3 88)
FP32_LAUNCHES = [(64, 4, 3), (32, 4, 3), (16, 4, 3), (32, 8, 2), (16, 2, 3), (16, 1, 3)]


def float32_sweep(path: str) -> None:
    """``FP32_LAUNCHES`` over float32 q and cache at the default split count, each launch's
    max |difference| from the first's output."""
    from tpserve.model.kernels.triton_decode_attention import default_num_splits

    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    rows = []
    for batch, ctx in ((1, 600), (1, 2000), (8, 600), (64, 1152)):
        per_seq = -(-ctx // page)
        kc = torch.randn(batch * per_seq, page, hkv, d, device=dev)
        vc = torch.randn_like(kc)
        tables = torch.randperm(batch * per_seq, device=dev).int().view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev)
        out = torch.empty_like(q)
        splits = default_num_splits(kc.dtype, batch, hkv, 2048)
        kv_bytes = 2 * batch * ctx * hkv * d * 4
        reference = None
        for bn, warps, stages in FP32_LAUNCHES:
            kw = dict(block_n=bn, num_warps=warps, num_stages=stages)
            row = {"batch": batch, "context": ctx, "splits": splits, "block_n": bn,
                   "warps": warps, "stages": stages}
            args = (q, kc, vc, tables, lens, 0.088, out, splits)
            us, diff, reference = time_against(
                lambda args=args, kw=kw: decode_attention(*args, **kw), out, reference)
            row.update(us=round(us, 2), kv_TBps=round(kv_bytes / us / 1e6, 3),
                       max_abs_diff=diff)
            rows.append(row)
            print(row, flush=True)
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
