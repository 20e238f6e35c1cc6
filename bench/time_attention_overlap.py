"""Decode attention beside prefill attention (``--overlap-attention``): a serving run's mixed
step, llama3-8b shapes per layer (32 query / 8 KV heads, head dim 128, page 16), timed on the
GPU with CUDA graphs of 32 launches (``tune_decode.time_graph``). For each case and cache
dtype: the decode kernel alone, the prefill kernel alone, ``paged_attention`` with both in
one stream (sequential), and with the decode kernel on a second stream (overlapped); the
overlapped output must equal the sequential one bit for bit (reported).

The launch shapes are the engine's mixed-step graphs': 64 decode slots (length 0 past the
real decodes) and a -1-padded tile table for 512 tokens.

    python bench/time_attention_overlap.py --out results/attention-overlap.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_decode import scattered_block_table, time_graph, write_rows  # noqa: E402

from tpserve.model.attention.triton_backend import (  # noqa: E402
    TritonMetadata,
    max_prefill_tiles,
    paged_attention,
    prefill_tiles,
)
from tpserve.model.kernels import triton_decode_attention as dec  # noqa: E402
from tpserve.model.kernels import triton_prefill_attention as pre  # noqa: E402
from tpserve.model.kernels.decode_launch import default_num_splits  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SLOTS, BUCKET = 64, 512  # the engine's mixed-step graph: decode (and sequence) slots, tokens
# name: (number of decodes, [(cached context, new tokens)] of the prefill sequences)
CASES = {
    "60dec_ctx1024-1280+chunk452@572": (60, [(572, 452)]),
    "60dec_ctx1024-1280+prompt452": (60, [(0, 452)]),
    "63dec_ctx1024-1280+chunk449@575": (63, [(575, 449)]),
    "32dec_ctx1024-1280+2x240": (32, [(0, 240), (784, 240)]),
}


def build(num_dec: int, prefills: list[tuple[int, int]], dtype: torch.dtype,
          dev: torch.device, gen: torch.Generator):
    """q, the two caches and the padded metadata of one mixed step (decodes first)."""
    dec_ctx = torch.randint(1024, 1281, (num_dec,), generator=gen).tolist()
    seqs = [(c - 1, 1) for c in dec_ctx] + prefills  # (cached, new)
    lens = [c + n for c, n in seqs]
    nblk = [-(-n // PAGE) for n in lens]
    total = sum(nblk)
    kc = (torch.randn(total, PAGE, HKV, D, generator=gen) * 2).to(dev)
    vc = torch.randn(total, PAGE, HKV, D, generator=gen).to(dev)
    if dtype == torch.float8_e4m3fn:
        kc, vc = kc.to(dtype), vc.to(dtype)
        kv_scale = torch.tensor([0.5, 0.25], dtype=torch.float32, device=dev)
    else:
        kc, vc, kv_scale = kc.to(dtype), vc.to(dtype), None
    num_seqs = len(seqs)
    assert num_seqs <= SLOTS
    table = scattered_block_table(nblk, SLOTS, gen)
    qlens = [n for _, n in seqs]
    n_tok = sum(qlens)
    q = torch.randn(BUCKET, HQ, D, generator=gen).to(dev, torch.bfloat16)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    qsl += [n_tok] * (SLOTS - num_seqs)
    seq_lens = lens + [0] * (SLOTS - num_seqs)
    dlens = torch.zeros(SLOTS, dtype=torch.int32)
    dlens[:num_dec] = torch.tensor(lens[:num_dec])
    tiles = prefill_tiles(qlens[num_dec:], num_dec)
    tiles += [-1] * (max_prefill_tiles(BUCKET, SLOTS) - len(tiles))
    i32 = dict(dtype=torch.int32, device=dev)
    meta = TritonMetadata(
        slot_mapping=torch.full((BUCKET,), -1, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=table.to(dev), num_decodes=0, max_query_len=BUCKET,
        max_seq_len=2048, prefill_tiles=torch.tensor(tiles, **i32),
        decode_slots=SLOTS, decode_seq_lens=dlens.to(dev))
    return q, kc, vc, kv_scale, meta, n_tok


def time_case(name: str, num_dec: int, prefills: list[tuple[int, int]], dtype: torch.dtype,
              side: torch.cuda.Stream) -> dict:
    """One row: the four timings of one case over one cache dtype, and the equality check."""
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, kv_scale, meta, n_tok = build(num_dec, prefills, dtype, side.device, gen)
    scale = D ** -0.5
    dec_only = TritonMetadata(**{**vars(meta), "num_decodes": SLOTS})  # no prefill work
    pre_only = TritonMetadata(**{**vars(meta), "decode_slots": 0})
    runs = {"decode": (dec_only, None), "prefill": (pre_only, None),
            "sequential": (meta, None), "overlapped": (meta, side)}
    row = {"case": name, "cache": str(dtype).removeprefix("torch."), "decodes": num_dec,
           "prefill": prefills}
    for label, (m, stream) in runs.items():
        row[f"{label}_us"] = round(time_graph(
            lambda m=m, stream=stream: paged_attention(q, kc, vc, m, scale, kv_scale, stream)),
            2)
    seq = paged_attention(q, kc, vc, meta, scale, kv_scale)[:n_tok]
    ovl = paged_attention(q, kc, vc, meta, scale, kv_scale, side)[:n_tok]
    torch.cuda.synchronize()
    row["overlapped_equals_sequential"] = bool(torch.equal(seq, ovl))
    row["saved_us"] = round(row["sequential_us"] - row["overlapped_us"], 2)
    return row


def forked(q, kc, vc, meta: TritonMetadata, scale: float, kv_scale, side: torch.cuda.Stream,
           split_div: int, prefill_first: bool) -> torch.Tensor:
    """``paged_attention``'s overlapped path with two tuning knobs (``--sweep``): the
    decode split count divided by ``split_div`` (fewer one-warp programs, so prefill
    programs find room on the SMs), and which kernel is launched first."""
    out = torch.empty_like(q)
    splits = max(1, default_num_splits(kc.dtype, SLOTS, HKV, meta.max_seq_len)
                 // split_div)
    partials = dec.split_partials(SLOTS, HQ, splits, D, q.device) if splits > 1 else None
    main = torch.cuda.current_stream(q.device)

    def prefill():
        pre.prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, meta.tiles(), scale, out,
                              kv_scale=kv_scale)
    if prefill_first:
        prefill()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        dec.decode_attention(q[:SLOTS], kc, vc, meta.block_tables[:SLOTS], meta.decode_lens(),
                             scale, out[:SLOTS], splits, kv_scale=kv_scale, partials=partials)
    if not prefill_first:
        prefill()
    main.wait_stream(side)
    return out


def sweep_case(name: str, num_dec: int, prefills: list[tuple[int, int]], dtype: torch.dtype,
               sides: dict[str, torch.cuda.Stream]) -> dict:
    """``time_case``'s sequential time against ``forked`` over its knobs and two side-stream
    priorities; each variant checked against the sequential result."""
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, kv_scale, meta, n_tok = build(num_dec, prefills, dtype, sides["normal"].device,
                                             gen)
    scale = D ** -0.5
    row = {"case": name, "cache": str(dtype).removeprefix("torch."), "decodes": num_dec,
           "sequential_us": round(time_graph(
               lambda: paged_attention(q, kc, vc, meta, scale, kv_scale)), 2)}
    want = paged_attention(q, kc, vc, meta, scale, kv_scale)[:n_tok]
    for prio, side in sides.items():
        for split_div in (1, 2, 4):
            for first in (False, True):
                def fn(side=side, split_div=split_div, first=first):
                    return forked(q, kc, vc, meta, scale, kv_scale, side, split_div, first)
                key = f"{prio}_div{split_div}_{'prefill' if first else 'decode'}_first"
                got = fn()[:n_tok]
                torch.cuda.synchronize()
                row[key] = {"us": round(time_graph(fn), 2),
                            "max_abs_diff": float((got.float() - want.float()).abs().max())}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true",
                   help="instead: forked()'s knobs (decode splits, launch order, priority)")
    a = p.parse_args()
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    rows = []
    for name, (num_dec, prefills) in CASES.items():
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            if a.sweep:
                sides = {"normal": side, "high": torch.cuda.Stream(dev, priority=-1)}
                rows.append(sweep_case(name, num_dec, prefills, dtype, sides))
            else:
                rows.append(time_case(name, num_dec, prefills, dtype, side))
            print(rows[-1], flush=True)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
