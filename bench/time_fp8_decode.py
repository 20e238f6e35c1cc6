"""Decode attention over a bf16 vs an FP8 (e4m3, scaled) KV cache, llama3-8b shapes per
layer (32 query / 8 KV heads, head dim 128, page 16), at a few batch sizes and contexts;
timed on the GPU with CUDA graphs of 32 launches (``tune_decode.time_graph``). The split
count is the heuristic's. Also checks each FP8 result against the bf16 kernel run over the
dequantized cache (max abs difference, reported).

    python bench/time_fp8_decode.py --out results/fp8-decode.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_decode import launch_knobs, time_graph, write_rows  # noqa: E402

from tpserve.model.kernels.decode_launch import (  # noqa: E402
    BF16_LAUNCH,
    FP8_LAUNCH,
    FP8_SMALL_LAUNCH,
    MAX_SPLITS,
    DecodeLaunch,
    decode_num_splits,
    default_num_splits,
)
from tpserve.model.kernels.torch_ops import dequantize_kv, quantize_kv  # noqa: E402
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402

SIZES = [(1, 1024), (1, 8192), (16, 2048), (64, 1024), (64, 4096), (128, 2048)]
# --sweep: FP8-cache launches (block_n, num_warps, num_stages, fp16_dot[, late_widen]),
# each at the heuristic's split count and, with --split-factors, that count times each
FP8_LAUNCHES = [(64, 4, 3, True), (128, 4, 3, False), (128, 4, 3, True), (128, 8, 3, True),
                (64, 4, 4, True), (128, 4, 2, True), (64, 8, 3, True), (32, 4, 4, True),
                (128, 8, 2, True), (256, 8, 2, True), (128, 4, 2, True, True),
                (64, 4, 3, True, True), (256, 8, 3, True, True), (128, 8, 3, True, True)]
# --sweep-set r4: the shipped launches with the scores as K q^T and/or the grid KV head
# first, on the cache they are shipped for ("bf16" or "fp8"), plus a few tiles
R34_FP8 = DecodeLaunch(128, 4, 2, True)  # the FP8 launch shipped in rounds 3 and 4
R4_LAUNCHES = [(c, lc._replace(**kw)) for c, lc in (("fp8", R34_FP8), ("bf16", BF16_LAUNCH))
               for kw in ({"swap_qk": True}, {"heads_first": True},
                          {"swap_qk": True, "heads_first": True})] + [
    ("fp8", R34_FP8._replace(block_n=64, num_stages=3, swap_qk=True)),
    ("fp8", R34_FP8._replace(block_n=64, num_stages=3, swap_qk=True, heads_first=True)),
    ("fp8", R34_FP8._replace(num_warps=8, swap_qk=True, heads_first=True)),
    ("fp8", R34_FP8._replace(num_stages=3, swap_qk=True, heads_first=True)),
    ("fp8", R34_FP8._replace(fp16_dot=False, swap_qk=True, heads_first=True))]
# --sweep-set r5: the V scale multiplied into the widened V tile (``scale_v``), at the
# shipped tile and at the tiles its lower register count may now favour
_SCALED = R34_FP8._replace(scale_v=True)
R5_LAUNCHES = [("fp8", R34_FP8)] + [
    ("fp8", _SCALED._replace(block_n=bn, num_warps=w, num_stages=st))
    for bn, w, st in ((128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
                      (128, 8, 2), (128, 8, 3), (256, 8, 2), (32, 4, 4))] + [
    ("fp8", _SCALED._replace(block_n=64, num_stages=3, heads_first=True))]
# --sweep-set r6: programs of one or two warps (the max and sum of a tile's scores then
# need fewer or no cross-warp exchanges through shared memory), best with more splits
R6_LAUNCHES = [("fp8", _SCALED._replace(block_n=bn, num_warps=w, num_stages=st))
               for bn, w, st in ((64, 4, 3), (32, 1, 3), (32, 1, 4), (16, 1, 4), (64, 2, 3),
                                 (32, 2, 3), (64, 2, 2), (128, 2, 2))]
# --sweep-set r7: the two FP8 launches (one warp; four for small grids) at small batches
R7_LAUNCHES = [("fp8", FP8_LAUNCH), ("fp8", FP8_SMALL_LAUNCH)]
# --sweep-set r8: the running maximum moved lazily (``lazy_rescale``) on the one-warp fp8
# launch and its 64-key / 4-stage neighbours, and on one-warp programs over a bf16 cache
_LAZY = FP8_LAUNCH._replace(lazy_rescale=True)
R8_LAUNCHES = [("fp8", FP8_LAUNCH), ("fp8", _LAZY), ("fp8", FP8_LAUNCH._replace(block_n=64)),
               ("fp8", _LAZY._replace(block_n=64)), ("fp8", _LAZY._replace(num_stages=4)),
               ("bf16", BF16_LAUNCH),
               ("bf16", BF16_LAUNCH._replace(block_n=32, num_warps=1, lazy_rescale=True))]
# --sweep-set r10: more one-warp fp8 programs a SM (registers capped with ``maxnreg``;
# 16-key tiles need 12.3 KB of shared memory against 20.6 KB, so up to 18 fit, not 11)
R10_LAUNCHES = [("fp8", FP8_LAUNCH), ("fp8", FP8_LAUNCH._replace(maxnreg=184)),
                ("fp8", FP8_LAUNCH._replace(block_n=16)),
                ("fp8", FP8_LAUNCH._replace(block_n=16, maxnreg=128)),
                ("fp8", FP8_LAUNCH._replace(block_n=16, num_stages=4, maxnreg=128)),
                ("fp8", FP8_LAUNCH._replace(block_n=16, num_stages=4, maxnreg=120)),
                ("fp8", FP8_LAUNCH._replace(block_n=16, num_stages=2, maxnreg=128)),
                ("fp8", FP8_SMALL_LAUNCH)]
LAUNCH_SETS = {"r4": R4_LAUNCHES, "r5": R5_LAUNCHES, "r6": R6_LAUNCHES, "r7": R7_LAUNCHES,
               "r8": R8_LAUNCHES, "r10": R10_LAUNCHES}


def time_launch(row: dict, name: str, fn, o: torch.Tensor, want: torch.Tensor,
                kv_bytes: int) -> None:
    """``row[name]``: ``fn``'s graph-timed microseconds, the KV bytes it read per second and
    its output ``o``'s max |difference| from ``want``; or the error of a launch that fails to
    compile."""
    try:
        us = time_graph(fn)
    except Exception as exc:  # noqa: BLE001 - a launch that fails to compile
        row[name] = repr(exc)[:120]
        return
    row[name] = {"us": round(us, 2), "kv_TBps": round(kv_bytes / us / 1e6, 3),
                 "max_abs_diff": float((o.float() - want).abs().max())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true", help="also time FP8_LAUNCHES on the fp8 cache")
    p.add_argument("--sweep-set", choices=["r3", *LAUNCH_SETS], default="r3",
                   help="with --sweep: r3 = FP8_LAUNCHES, r4 = R4_LAUNCHES (both caches), "
                        "r5 = R5_LAUNCHES, r6 = R6_LAUNCHES, r7 = R7_LAUNCHES, r8 = R8_LAUNCHES, "
                        "r10 = R10_LAUNCHES")
    p.add_argument("--split-factors", type=int, nargs="*", default=[],
                   help="with --sweep, also time each launch at the heuristic's split count "
                        "times these (powers of two, capped at MAX_SPLITS)")
    p.add_argument("--sizes", default=None,
                   help="batch:context pairs, comma-separated (default: SIZES)")
    a = p.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    scale = torch.tensor([0.02, 0.01], device=dev)
    rows = []
    sizes = SIZES if a.sizes is None else [tuple(int(v) for v in bc.split(":"))
                                          for bc in a.sizes.split(",")]
    for batch, ctx in sizes:
        nb = batch * (ctx // page)
        k = torch.randn(nb, page, hkv, d, device=dev) * 3
        v = torch.randn_like(k)
        k8, v8 = quantize_kv(k, scale[0]), quantize_kv(v, scale[1])
        kb = dequantize_kv(k8, scale[0]).bfloat16()  # the same values (up to bf16 rounding)
        vb = dequantize_kv(v8, scale[1]).bfloat16()
        del k, v
        tables = torch.randperm(nb, device=dev).int().view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev)
        splits = decode_num_splits(batch, hkv, ctx)  # the bf16 launch's; the sweeps' base
        out = {}
        row = {"batch": batch, "context": ctx, "splits": splits}
        for name, kc, vc, ks in (("bf16", kb, vb, None), ("fp8", k8, v8, scale)):
            o = torch.empty_like(q)
            n = default_num_splits(kc.dtype, batch, hkv, ctx)
            row[f"{name}_splits"] = n
            args = (q, kc, vc, tables, lens, 0.088, o, n)

            def fn(args=args, ks=ks):
                return decode_attention(*args, kv_scale=ks)
            us = time_graph(fn)
            out[name] = o.float()
            nbytes = 2 * batch * ctx * hkv * d * kc.element_size()
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_kv_TBps"] = round(nbytes / us / 1e6, 3)
        row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
        row["max_abs_diff"] = float((out["fp8"] - out["bf16"]).abs().max())
        factors = [1] + [f for f in a.split_factors if splits * f <= MAX_SPLITS]
        if a.sweep and a.sweep_set in LAUNCH_SETS:
            caches = {"bf16": (kb, vb, None), "fp8": (k8, v8, scale)}
            for (cache, lc), factor in [(x, f) for x in LAUNCH_SETS[a.sweep_set]
                                        for f in factors]:
                kc, vc, ks = caches[cache]
                o = torch.empty_like(q)

                def fn(o=o, lc=lc, kc=kc, vc=vc, ks=ks, qtl=(q, tables, lens),
                       n=splits * factor):
                    return decode_attention(qtl[0], kc, vc, qtl[1], qtl[2], 0.088, o, n,
                                            kv_scale=ks, **launch_knobs(lc))
                time_launch(row, f"{cache}{list(lc)}{f',x{factor}' if factor > 1 else ''}",
                            fn, o, out["bf16"], 2 * batch * ctx * hkv * d * kc.element_size())
        for launch, factor in ([(x, f) for x in FP8_LAUNCHES for f in factors]
                               if a.sweep and a.sweep_set == "r3" else []):
            bn, warps, stages, f16, *late = launch
            late = bool(late and late[0])
            o = torch.empty_like(q)

            def fn(o=o, bn=bn, warps=warps, stages=stages, f16=f16, late=late,
                   args=(q, k8, v8, tables, lens, 0.088), splits=splits * factor):
                return decode_attention(*args, o, splits,
                                        block_n=bn, num_warps=warps, num_stages=stages,
                                        kv_scale=scale, fp16_dot=f16, late_widen=late)
            name = (f"fp8[{bn},{warps},{stages}{',f16' if f16 else ''}{',late' if late else ''}"
                    f"{f',x{factor}' if factor > 1 else ''}]")
            time_launch(row, name, fn, o, out["bf16"], 2 * batch * ctx * hkv * d)
        rows.append(row)
        print(row, flush=True)
        del kb, vb, k8, v8
        torch.cuda.empty_cache()
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
