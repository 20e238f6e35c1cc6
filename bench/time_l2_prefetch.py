"""Does prefetching o_proj's fp8 weight into L2 while decode attention runs pay? A decode
step's attention block of Llama-3-8B (64 sequences x 1,152 keys over an fp8 cache, the
per-token quantizer, the Triton W8A8 o_proj at M = 64), 32 layers with their own caches
and weights, captured in one CUDA graph and replayed between CUDA events.

Variants per layer:
- ``plain``: attention, quantizer, o_proj;
- ``inline``: a prefetch kernel (``prefetch.global.L2`` of every 128-byte line of the
  layer's o_proj weight; it only issues the requests, so it ends at once) launched just
  before attention, on the same stream;
- ``side``: the same prefetch kernel on a second stream forked before attention and
  joined before the quantizer;
- ``*_last``: the prefetch with the ``evict_last`` L2 policy.

The decode attention of a step reads ~151 MB of cache a layer at ~2.75 TB/s, below the
H200's ~4.8 TB/s, so 16.8 MB more might load beside it; the GEMM then reads L2.

    python bench/time_l2_prefetch.py --out results/l2-prefetch.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_decode import write_rows  # noqa: E402

from tpserve.model.kernels.decode_launch import default_num_splits  # noqa: E402
from tpserve.model.kernels.torch_ops import quantize_kv  # noqa: E402
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tpserve.model.kernels.triton_fp8_quant import FP8, quantize_per_token  # noqa: E402
from tpserve.model.kernels.triton_w8a8 import w8a8_linear  # noqa: E402

LINE = 128
LINES_PER_PROGRAM = 1024


@triton.jit
def _prefetch_kernel(ptr, last_line, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program ``p`` asks L2 for lines ``p * LINES ..`` of the buffer (clamped to its last
    line); nothing is loaded into registers."""
    line = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), last_line)
    ptrs = ptr + line.to(tl.int64) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, evict_last: bool) -> None:
    lines = triton.cdiv(t.numel() * t.element_size(), LINE)
    _prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](
        t.view(torch.uint8), lines - 1, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last,
        num_warps=4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1152)
    p.add_argument("--replays", type=int, default=15)
    a = p.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, page, hidden = 32, 8, 128, 16, 4096
    nb = a.batch * (a.context // page)
    scale = torch.tensor([0.02, 0.01], device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(a.layers):
        k = quantize_kv(torch.randn(nb, page, hkv, d, device=dev, generator=g) * 3, scale[0])
        v = quantize_kv(torch.randn(nb, page, hkv, d, device=dev, generator=g), scale[1])
        w = (torch.randn(hidden, hq * d, device=dev, generator=g) * 8).to(FP8)
        ws = torch.full((hidden,), 1e-3, device=dev)
        layers.append((k, v, w, ws))
    tables = torch.randperm(nb, device=dev).int().view(a.batch, -1)
    lens = torch.full((a.batch,), a.context, dtype=torch.int32, device=dev)
    q = torch.randn(a.batch, hq, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    splits = default_num_splits(FP8, a.batch, hkv, 2048)  # as the engine's graphs (max len)
    side = torch.cuda.Stream(dev)

    def step(mode: str) -> torch.Tensor:
        ys = []
        for k, v, w, ws in layers:
            main = torch.cuda.current_stream()
            if mode.startswith("inline"):
                prefetch(w, mode.endswith("_last"))
            if mode.startswith("side"):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w, mode.endswith("_last"))
            decode_attention(q, k, v, tables, lens, 0.088, out, splits, kv_scale=scale)
            if mode.startswith("side"):
                main.wait_stream(side)
            xq, xs = quantize_per_token(out.view(a.batch, hq * d))
            ys.append(w8a8_linear(xq, xs, w, ws, None, torch.bfloat16))
        return torch.stack(ys)

    rows = []
    ref = None
    for mode in ("plain", "inline", "inline_last", "side", "side_last", "plain"):
        y = step(mode)  # compile, warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step(mode)
        times = []
        for _ in range(a.replays):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3 / a.layers)
        ref = y.clone() if ref is None else ref
        row = {"mode": mode, "us_per_layer": round(sorted(times)[len(times) // 2], 2),
               "min_us": round(min(times), 2), "equal": bool(torch.equal(y, ref))}
        rows.append(row)
        print(row, flush=True)
        del graph
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
