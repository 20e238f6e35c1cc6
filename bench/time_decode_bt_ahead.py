"""Decode attention with the block-table entries loaded a tile ahead (``DecodeLaunch.
bt_ahead``) against the loop as shipped, Llama-3-8B's layer (32 / 8 heads, D 128, page 16),
bf16 and e4m3 caches, timed in CUDA graphs of 32 launches (``tune_decode.time_graph``).

Without it the K/V loads of a tile hang on the block-table load of the same iteration and
the compiled loop waits for every outstanding copy at its top (``DEPBAR.LE SB0, 0x0``);
with it the pipeliner keeps ``num_stages - 1`` tiles in flight (``offline_sass.py
--bt-ahead``). Each launch's output is compared with the cache's default launch (max abs
difference).

    python bench/time_decode_bt_ahead.py --out results/bt-ahead.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from time_kv_layout import make_cache  # noqa: E402
from tune_decode import launch_knobs, scattered_block_table, time_graph, write_rows  # noqa: E402

from tpserve.model.kernels.decode_launch import (  # noqa: E402
    BF16_LAUNCH,
    FP8_LAUNCH,
    FP8_SMALL_LAUNCH,
    DecodeLaunch,
    decode_num_splits,
    default_launch,
)
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
# FP8_LAUNCH before bt_ahead (up to 1a96c1a): 32-key one-warp tiles, 3 stages
BEFORE_BT_AHEAD = DecodeLaunch(32, 1, 3, True, scale_v=True, target_programs=1024)
SIZES = [(64, 1152), (32, 1152), (128, 2048), (16, 2048), (8, 1152), (1, 1024), (64, 512)]
LAUNCHES = {
    "bf16": {
        "default+bt": BF16_LAUNCH._replace(bt_ahead=True),
        "w4n64s2+bt": BF16_LAUNCH._replace(num_stages=2, bt_ahead=True),
        "w4n64s4+bt": BF16_LAUNCH._replace(num_stages=4, bt_ahead=True),
        "w4n32s4+bt": BF16_LAUNCH._replace(block_n=32, num_stages=4, bt_ahead=True),
        "w2n32s3+bt": BF16_LAUNCH._replace(block_n=32, num_warps=2, target_programs=512,
                                           bt_ahead=True),
    },
    "fp8": {
        "w1n32s3": BEFORE_BT_AHEAD,
        "default+bt": None,  # the default launch of the grid, with bt_ahead
        "w1n32s3+bt": FP8_LAUNCH._replace(bt_ahead=True),
        "w1n32s4+bt": FP8_LAUNCH._replace(num_stages=4, bt_ahead=True),
        "w1n16s3+bt": FP8_LAUNCH._replace(block_n=16, bt_ahead=True),
        "w1n16s4+bt": FP8_LAUNCH._replace(block_n=16, num_stages=4, bt_ahead=True),
        "w1n16s5+bt": FP8_LAUNCH._replace(block_n=16, num_stages=5, bt_ahead=True),
        "w1n32s3x2+bt": FP8_LAUNCH._replace(target_programs=2048, bt_ahead=True),
        "w4n64s3+bt": FP8_LAUNCH._replace(block_n=64, num_warps=4, target_programs=264,
                                          bt_ahead=True),
        "w4n128s3+bt": FP8_SMALL_LAUNCH._replace(num_stages=3, bt_ahead=True),
        "w4n128s2+bt": FP8_SMALL_LAUNCH._replace(bt_ahead=True),
    },
}


def rows_for(dev, sizes, pool_blocks: int, only: list[str] | None) -> list[dict]:
    """``pool_blocks``: the caches hold this many blocks (at least the batch's) and the
    batch's blocks are a random draw from all of them, as in the engine's pool (a layer's
    K or V over a 115 GiB pool is ~1.8 GiB, ~112 k blocks of 16 KiB in fp8)."""
    scale = torch.tensor([0.02, 0.01], device=dev)
    rows = []
    for batch, ctx in sizes:
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        nb = batch * (ctx // PAGE)
        pool = max(nb, pool_blocks)
        table = scattered_block_table([ctx // PAGE] * batch).to(dev)
        if pool > nb:
            table = torch.randperm(pool, device=dev)[:nb].int()[table.long()]
        caches = make_cache(pool, PAGE, dev, scale)
        row = {"batch": batch, "context": ctx, "pool_blocks": pool}
        for dtype, (kc, vc) in caches.items():
            kv_bytes = 2 * batch * ctx * HKV * D * kc.element_size()
            base_launch = default_launch(kc.dtype, batch, HKV)
            named = [("default", base_launch)]
            for name, lc in LAUNCHES[dtype].items():
                if only is not None and name not in only:
                    continue
                named.append((name, base_launch._replace(bt_ahead=True) if lc is None else lc))
            ref = None
            for name, lc in named:
                n = decode_num_splits(batch, HKV, ctx, lc.target_programs)
                knobs = launch_knobs(lc)
                o = torch.empty_like(q)

                def fn(o=o, kc=kc, vc=vc, n=n, knobs=knobs, fp8=dtype == "fp8",
                       qtl=(q, table, lens)):
                    return decode_attention(qtl[0], kc, vc, qtl[1], qtl[2], 0.088, o, n,
                                            kv_scale=scale if fp8 else None, **knobs)
                try:
                    us = time_graph(fn)
                except Exception as exc:  # noqa: BLE001 - a launch that does not compile
                    row[f"{dtype}_{name}"] = repr(exc)[:160]
                    continue
                ref = o.float() if ref is None else ref
                row[f"{dtype}_{name}"] = {"us": round(us, 2),
                                          "TBps": round(kv_bytes / us / 1e6, 3), "splits": n,
                                          "diff": float((o.float() - ref).abs().max())}
        rows.append(row)
        print(row, flush=True)
        del caches
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", nargs="*", default=[f"{b}x{c}" for b, c in SIZES],
                   help="BATCHxCONTEXT")
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="draw the batch's blocks from a pool of this many (0: just its own)")
    p.add_argument("--launches", nargs="*", help="only these of LAUNCHES (default: all)")
    a = p.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes]
    write_rows(a.out, rows_for(torch.device("cuda"), sizes, a.pool_blocks, a.launches))


if __name__ == "__main__":
    main()
