"""Decode and prefill attention over two physical KV-cache layouts, Llama-3-8B's layer on
the GPU (32 query / 8 KV heads, head dim 128), timed in CUDA graphs of 32 launches
(``tune_decode.time_graph``).

- ``nhd``: ``[blocks, page, Hkv, D]`` as allocated today: one token's row of one KV head is
  ``D`` elements, the next token's row of that head ``Hkv * D`` further on;
- ``hnd``: ``[blocks, Hkv, page, D]`` in memory, handed to the kernels as the transposed
  view ``[blocks, page, Hkv, D]`` (the kernels take strides): a page of one head is one
  contiguous run of ``page * D`` elements (2 KiB at page 16 over an fp8 cache).

The values are the same in both; each result is checked against the ``nhd`` one (max abs
difference, expected 0). Decode: the default launch of the cache dtype at its default split
count, plus ``--launches`` overrides on the fp8 cache; prefill: a 448-token chunk over 576
cached tokens (a mixed serving step's shape) and 4 x 113 over 1,700.

    python bench/time_kv_layout.py --out results/kv-layout.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_decode import launch_knobs, scattered_block_table, time_graph, write_rows  # noqa: E402

from tpserve.model.attention.triton_backend import prefill_tiles  # noqa: E402
from tpserve.model.kernels.decode_launch import (  # noqa: E402
    FP8_LAUNCH,
    FP8_SMALL_LAUNCH,
    decode_num_splits,
    default_num_splits,
)
from tpserve.model.kernels.torch_ops import quantize_kv  # noqa: E402
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tpserve.model.kernels.triton_prefill_attention import prefill_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128
DECODE_SIZES = [(64, 1152), (32, 1152), (128, 2048), (16, 2048), (8, 1152), (1, 1024)]
PREFILL_CASES = {"chunk_448_at_576": [(576, 448)], "chunks_4x113_at_1700": [(1700, 113)] * 4}
# fp8-cache launch overrides timed on each layout: name -> DecodeLaunch (at
# decode_num_splits towards its target_programs)
LAUNCHES = {
    "w1n32": FP8_LAUNCH,
    "w1n64": FP8_LAUNCH._replace(block_n=64),
    "w1n16s4": FP8_LAUNCH._replace(block_n=16, num_stages=4),
    "w4n64s3": FP8_LAUNCH._replace(block_n=64, num_warps=4, num_stages=3, target_programs=264),
    "w4n128s2": FP8_SMALL_LAUNCH._replace(target_programs=264),
    "w2n64s3": FP8_LAUNCH._replace(block_n=64, num_warps=2, target_programs=512),
}


def layouts(values: torch.Tensor, page: int, kinds: list[str]) -> dict[str, torch.Tensor]:
    """``values [blocks, page, Hkv, D]`` copied into each layout (as its ``[blocks, page,
    Hkv, D]`` view)."""
    out = {}
    for kind in kinds:
        if kind.startswith("nhd"):
            out[kind] = values.clone()
        else:
            phys = values.transpose(1, 2).contiguous()  # [blocks, Hkv, page, D]
            out[kind] = phys.transpose(1, 2)
    return out


def make_cache(nblocks: int, page: int, dev: torch.device, scale: torch.Tensor):
    k = torch.randn(nblocks, page, HKV, D, device=dev) * 3
    v = torch.randn_like(k)
    return {"fp8": (quantize_kv(k, scale[0]), quantize_kv(v, scale[1])),
            "bf16": (k.bfloat16(), v.bfloat16())}


def decode_rows(dev, scale, pages: list[int], launches: list[str]) -> list[dict]:
    rows = []
    for batch, ctx in DECODE_SIZES:
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        for page in pages:
            nb = batch * (ctx // page)
            tables = torch.randperm(nb, device=dev).int().view(batch, -1)
            caches = make_cache(nb, page, dev, scale)
            kinds = ["nhd", "hnd"] if page == pages[0] else ["hnd"]
            row = {"batch": batch, "context": ctx, "page": page}
            ref = {}
            for dtype, (k, v) in caches.items():
                ks, vs = layouts(k, page, kinds), layouts(v, page, kinds)
                kv_bytes = 2 * batch * ctx * HKV * D * k.element_size()
                named = [("default", None)] + ([(n, LAUNCHES[n]) for n in launches]
                                               if dtype == "fp8" else [])
                for lname, lc in named:
                    if lc is None:
                        n = default_num_splits(k.dtype, batch, HKV, ctx)
                        knobs = {}
                    else:
                        n = decode_num_splits(batch, HKV, ctx, lc.target_programs)
                        knobs = launch_knobs(lc)
                    for kind in kinds:
                        o = torch.empty_like(q)

                        def fn(o=o, kc=ks[kind], vc=vs[kind], n=n, knobs=knobs, dtype=dtype,
                               qtl=(q, tables, lens)):
                            return decode_attention(qtl[0], kc, vc, qtl[1], qtl[2], 0.088, o, n,
                                                    kv_scale=scale if dtype == "fp8" else None,
                                                    **knobs)
                        key = f"{dtype}_{lname}_{kind}{page}"
                        try:
                            us = time_graph(fn)
                        except Exception as exc:  # noqa: BLE001 - a launch that fails
                            row[key] = repr(exc)[:120]
                            continue
                        base = ref.setdefault(dtype, o.float())
                        row[key] = {"us": round(us, 2), "TBps": round(kv_bytes / us / 1e6, 3),
                                    "splits": n, "diff": float((o.float() - base).abs().max())}
            rows.append(row)
            print(row, flush=True)
            del caches
            torch.cuda.empty_cache()
    return rows


def prefill_rows(dev, scale, pages: list[int]) -> list[dict]:
    rows = []
    for name, seqs in PREFILL_CASES.items():
        lens = [c + n for c, n in seqs]
        qlens = [n for _, n in seqs]
        qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32,
                           device=dev)
        q = torch.randn(sum(qlens), HQ, D, dtype=torch.bfloat16, device=dev)
        tiles = torch.tensor(prefill_tiles(qlens, 0, 64), dtype=torch.int32, device=dev)
        for page in pages:
            nblk = [-(-n // page) for n in lens]
            table = scattered_block_table(nblk)
            meta = (table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), qsl,
                    tiles, 0.088)
            caches = make_cache(sum(nblk), page, dev, scale)
            kinds = ["nhd", "hnd"] if page == pages[0] else ["hnd"]
            row = {"case": name, "page": page}
            for dtype, (k, v) in caches.items():
                ks, vs = layouts(k, page, kinds), layouts(v, page, kinds)
                base = None
                for kind in kinds:
                    out = torch.empty_like(q)

                    def fn(out=out, kc=ks[kind], vc=vs[kind], dtype=dtype, q=q, meta=meta):
                        return prefill_attention(q, kc, vc, *meta, out,
                                                 kv_scale=scale if dtype == "fp8" else None)
                    us = time_graph(fn)
                    base = out.float() if base is None else base
                    row[f"{dtype}_{kind}{page}"] = {
                        "us": round(us, 2), "diff": float((out.float() - base).abs().max())}
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pages", type=int, nargs="+", default=[16, 32])
    p.add_argument("--launches", nargs="*", default=list(LAUNCHES))
    a = p.parse_args()
    dev = torch.device("cuda")
    scale = torch.tensor([0.02, 0.01], device=dev)
    rows = decode_rows(dev, scale, a.pages, a.launches) + prefill_rows(dev, scale, a.pages)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
