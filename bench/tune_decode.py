"""Decode attention at batch 1 and 64 for several split counts (the split heuristic's
inputs), timed on the GPU with CUDA graphs of 32 launches (one per layer).

    python bench/tune_decode.py --out results/decode-splits.json
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
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
