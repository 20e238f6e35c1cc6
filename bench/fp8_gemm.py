"""FP8 (e4m3) against bf16 GEMMs on the Llama-3-8B projection shapes, timed inside CUDA graphs.

For each shape (qkv, o, gate_up, down) and M: bf16 ``F.linear``, the fused Triton per-token
quantizer + ``torch._scaled_mm`` (W8A8, ``fused_w8a8``), the Triton weight-only kernel
with its default launch (``weight_only``) and, at M <= 128 with ``--sweep``, each candidate
launch of ``CANDIDATES``; the W8A8 products of activations quantized beforehand (as the
fused norm and gate kernels hand them over): ``torch._scaled_mm`` (``mm_only``; with
``use_fast_accum``, ``mm_fast``), the
same with the operands swapped (``mm_swapped``: ``(W x^T)^T``, cuBLAS tiles the other
way) and the Triton split-K kernel's table launch (``w8a8``; ``w8a8_fast``: its K chunks summed in
the tensor cores, as ``--fp8-fast-accum`` runs it) and, with ``--sweep-sets w8a8``, each
of ``W8A8_CANDIDATES`` (at ``W8A8_M``), both ways. Timing: ``--calls`` back-to-back calls captured in one CUDA graph,
replayed ``--replays`` times between CUDA events; the median replay over the calls is the
per-call time (no Python launch overhead, as in the server's decode graphs). The calls cycle
over copies of the weight whose total is >= ``--rotate-mib`` (default 256 MiB, five times
the H200's 50 MiB L2), so every call streams its weight from HBM as a decode step does.
GB/s: the variant's weight bytes (fp8 + float32 scales, or bf16) + activations in and out.

    python bench/fp8_gemm.py --out results/h200-DATE-fp8-gemm.json [--sweep]
    python bench/fp8_gemm.py --compile-only --worker 3/8 --sweep   # fill the Triton cache

Prints one JSON line per (shape, M), then a table; writes one JSON with device and commit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.model.kernels import triton_fp8, triton_fp8_quant, triton_w8a8  # noqa: E402
from tpserve.model.quant.fp8 import quantize_per_row  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMALL_M = [1, 2, 4, 8, 16, 32, 64, 128]
LARGE_M = [256, 512, 2048, 8192]
WO_MAX_M = 512  # the weight-only kernel is timed up to here (it is a decode kernel)
# weight-only launches for --sweep (WoConfig strings); "dot" block_m "M": max(16, pow2(M))
# capped at 64.
CANDIDATES = ["dot,16,32,256,1,4,1", "dot,M,32,256,0,4,3", "dot,M,32,256,0,4,4",
              "dot,M,32,512,0,4,3", "dot,M,64,256,0,4,3", "dot,M,32,256,0,8,3",
              "dot,M,32,128,0,4,4", "dot,M,32,256,2,4,3", "dot,M,32,256,1,4,3",
              "dot,M,64,128,0,4,3", "dot,M,64,128,0,4,4", "dot,64,128,64,1,8,3"]

# Triton W8A8 launches for --sweep-sets w8a8 ("M": the rows per tile, max(16, pow2(M))
# capped at 128), timed at M in W8A8_M
W8A8_CANDIDATES = ["w8a8,M,64,128,0,4,4", "w8a8,M,128,128,0,4,4", "w8a8,M,128,128,0,8,4",
                   "w8a8,M,128,256,0,8,3", "w8a8,M,256,128,0,8,3", "w8a8,M,64,256,0,4,4",
                   "w8a8,M,128,128,0,4,5", "w8a8,M,128,64,0,4,4", "w8a8,M,128,128,1,4,4",
                   "w8a8,M,128,128,2,4,4", "w8a8,M,128,128,4,4,4", "w8a8,64,128,128,0,4,4",
                   "w8a8,64,128,256,0,4,3", "w8a8,64,64,256,0,4,4",
                   # round 16, around the fast accumulation's best (64 x 64 x 256)
                   "w8a8,64,64,256,0,4,3", "w8a8,64,32,256,0,4,4", "w8a8,64,64,256,0,4,5",
                   "w8a8,64,64,512,0,4,3", "w8a8,64,32,512,0,4,3", "w8a8,64,64,128,0,4,6",
                   "w8a8,64,128,256,0,4,4", "w8a8,64,64,256,2,4,3", "w8a8,64,64,256,0,8,4"]
W8A8_M = (16, 32, 64, 128, 256, 512)

# one-row-per-program GEMV launches ("gemv" + r: reduce each step, e: evict-first weights),
# timed at M <= 4
GEMV_CANDIDATES = [
    "gemv,1,8,1024,0,4", "gemvr,1,8,1024,0,4", "gemve,1,8,1024,0,4", "gemvre,1,8,1024,0,4",
    "gemve,1,8,1024,0,4,3", "gemvre,1,8,1024,0,4,3", "gemve,1,16,512,0,4",
    "gemvre,1,16,512,0,4", "gemve,1,16,512,0,4,3", "gemve,1,16,1024,0,8",
    "gemvre,1,16,1024,0,8", "gemve,1,4,2048,0,4", "gemvre,1,4,2048,0,4",
    "gemve,1,8,2048,0,8", "gemvre,1,8,2048,0,8", "gemve,1,32,512,0,8", "gemvre,1,32,512,0,8",
    "gemvre,1,32,256,0,4", "gemve,1,4,1024,0,4", "gemvre,1,2,2048,0,4", "gemve,1,8,512,0,4",
    "gemvre,1,8,512,0,2", "gemvre,1,16,256,0,2", "gemvre,1,64,256,0,8"]


def w8a8_candidates_for(m: int, specs: list[str] | None = None) -> list[str]:
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    out = []
    for spec in W8A8_CANDIDATES if specs is None else specs:
        name = spec.replace(",M,", f",{bm},")
        if name not in out:
            out.append(name)
    return out


def candidates_for(m: int, sets: tuple[str, ...] = ("tiled", "gemv")) -> list[str]:
    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    out = []
    specs = ((CANDIDATES if "tiled" in sets else [])
             + (GEMV_CANDIDATES if "gemv" in sets and m <= 4 else []))
    for spec in specs:
        cfg = triton_fp8.WoConfig.parse(spec.replace(",M,", f",{bm},"))
        if cfg.kind == "dot" and cfg.block_m == 64 and m < 32:
            continue
        name = ",".join(str(v) for v in cfg)
        if name not in out:
            out.append(name)
    return out


def capture(fns) -> torch.cuda.CUDAGraph:
    """``fns`` run once on a side stream (compiles, cuBLAS workspaces: outside the capture),
    then captured back to back, in order, in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return g


def graph_us(fns, replays: int) -> float:
    """Per-call µs of ``fns`` (one call each, in order) captured back to back in a graph."""
    g = capture(fns)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del g
    return sorted(times)[len(times) // 2]


def copies_for(nbytes: int, rotate_mib: int, calls: int) -> int:
    return max(1, min(calls, math.ceil(rotate_mib * 2**20 / nbytes)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=SMALL_M + LARGE_M)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time every CANDIDATES launch")
    ap.add_argument("--sweep-sets", nargs="+", default=["tiled", "gemv"],
                    choices=["tiled", "gemv", "w8a8"], help="which candidate lists --sweep times")
    ap.add_argument("--wo", nargs="*", default=[], help="extra weight-only launches to time")
    ap.add_argument("--w8a8", nargs="*", default=[],
                    help="extra Triton W8A8 launches to time with fast accumulation, at every M "
                         "(\"w8a8,BM,BN,BK,SPLIT,WARPS,STAGES\"; BM \"M\": as W8A8_CANDIDATES)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--compile-only", action="store_true",
                    help="run each launch once, untimed (fills the Triton cache)")
    ap.add_argument("--worker", default="0/1", help="i/n: this process's share of the work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit measured (else git here)")
    a = ap.parse_args()
    wi, wn = (int(v) for v in a.worker.split("/"))
    dev = torch.device("cuda")
    rows = []
    task = -1
    for name in a.shapes:
        n, k = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        wq, ws = quantize_per_row(w)
        ws1 = ws.view(-1).contiguous()
        nc8 = 1 if a.compile_only else copies_for(wq.numel(), a.rotate_mib, a.calls)
        nc16 = 1 if a.compile_only else copies_for(w.numel() * 2, a.rotate_mib, a.calls)
        wq_c = [wq] + [wq.clone() for _ in range(nc8 - 1)]
        w_c = [w] + [w.clone() for _ in range(nc16 - 1)]
        for m in a.m:
            task += 1
            if task % wn != wi:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            ref = x.float() @ (wq.float() * ws).t()
            act = m * k * 2 + m * n * 2
            b8, b16 = n * k + n * 4 + act, 2 * n * k + act
            calls = 1 if a.compile_only else a.calls

            def bf16(i, x=x, w_c=w_c, nc16=nc16):
                return lambda: F.linear(x, w_c[i % nc16])

            def fused(i, x=x, wq_c=wq_c, nc8=nc8, ws1=ws1):
                def f():
                    q, s = triton_fp8_quant.quantize_per_token(x)
                    return torch._scaled_mm(q, wq_c[i % nc8].t(), scale_a=s,
                                            scale_b=ws1.view(1, -1), out_dtype=torch.bfloat16)
                return f

            def wo(cfg, x=x, wq_c=wq_c, nc8=nc8, ws1=ws1):
                def call(j):
                    w = wq_c[j % nc8]
                    return lambda: triton_fp8.weight_only_linear(x, w, ws1, None, cfg)
                return call

            xq, xs = quantize_per_row(x)

            def mm_only(i, xq=xq, xs=xs, wq_c=wq_c, nc8=nc8, ws1=ws1):
                return lambda: torch._scaled_mm(xq, wq_c[i % nc8].t(), scale_a=xs,
                                                scale_b=ws1.view(1, -1),
                                                out_dtype=torch.bfloat16)

            def mm_fast(i, xq=xq, xs=xs, wq_c=wq_c, nc8=nc8, ws1=ws1):
                # cuBLAS's fast accumulation: the tensor cores' own sums, never promoted
                return lambda: torch._scaled_mm(xq, wq_c[i % nc8].t(), scale_a=xs,
                                                scale_b=ws1.view(1, -1),
                                                out_dtype=torch.bfloat16, use_fast_accum=True)

            def mm_swapped(i, xq=xq, xs=xs, wq_c=wq_c, nc8=nc8, ws1=ws1):
                # y^T = W x^T: the weight is the row-major first operand, x^T column-major
                return lambda: torch._scaled_mm(
                    wq_c[i % nc8], xq.t(), scale_a=ws1.view(-1, 1),
                    scale_b=xs.view(1, -1), out_dtype=torch.bfloat16).t().contiguous()

            def w8a8(cfg, fast=False, xq=xq, xs=xs, wq_c=wq_c, nc8=nc8, ws1=ws1):
                def call(j):
                    w = wq_c[j % nc8]
                    return lambda: triton_w8a8.w8a8_linear(xq, xs, w, ws1, None,
                                                           torch.bfloat16, cfg, fast)
                return call

            variants = {"bf16": (bf16, b16), "fused_w8a8": (fused, b8),
                        "mm_only": (mm_only, b8), "mm_fast": (mm_fast, b8),
                        "mm_swapped": (mm_swapped, b8),
                        "w8a8": (w8a8(None), b8), "w8a8_fast": (w8a8(None, True), b8)}
            if m <= WO_MAX_M:
                variants["weight_only"] = (wo(None), b8)
            extra = list(a.wo) + (candidates_for(m, tuple(a.sweep_sets)) if a.sweep and m <= 128 else [])
            for spec in extra:
                variants[f"wo[{spec}]"] = (wo(spec), b8)
            if a.sweep and "w8a8" in a.sweep_sets and m in W8A8_M:
                for spec in w8a8_candidates_for(m):
                    variants[f"w8a8[{spec}]"] = (w8a8(spec), b8)
                    variants[f"w8a8_fast[{spec}]"] = (w8a8(spec, True), b8)
            for spec in a.w8a8:
                for name_m in w8a8_candidates_for(m, [spec]):
                    variants[f"w8a8_fast[{name_m}]"] = (w8a8(name_m, True), b8)
            row = {"shape": name, "m": m, "n": n, "k": k,
                   "default_config": ",".join(map(str, triton_fp8.weight_only_blocks(m, n, k))),
                   "w8a8_config": ",".join(map(str, triton_w8a8.w8a8_blocks(m, n, k))),
                   "w8a8_fast_config": ",".join(map(str, triton_w8a8.w8a8_blocks(m, n, k,
                                                                                 True)))}
            for vname, (make, nbytes) in variants.items():
                fns = [make(i) for i in range(calls)]
                try:
                    if a.compile_only:
                        fns[0]()
                        torch.cuda.synchronize()
                        continue
                    us = graph_us(fns, a.replays)
                    err = ((fns[0]().float() - ref).abs().max() / ref.abs().max()).item()
                    row[vname] = {"us": round(us, 2), "gbps": round(nbytes / us / 1e3, 1),
                                  "max_rel_err": round(err, 5)}
                except Exception as exc:  # noqa: BLE001 - a launch that fails to compile
                    row[vname] = {"error": repr(exc)[:200]}
            if a.compile_only:
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
        del w_c, wq_c
        torch.cuda.empty_cache()
    if a.compile_only:
        return
    print_table(rows)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "timing": f"CUDA graph of {a.calls} calls, median of {a.replays} replays, "
                     f"weights rotated over >= {a.rotate_mib} MiB",
           "commit": git_commit(a.commit)[0], "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


def print_table(rows: list[dict]) -> None:
    """us / GB/s of bf16, fused W8A8, the default weight-only and the best swept launch."""
    def cell(r, key):
        v = r.get(key) or {}
        return f"{v['us']:8.1f} {v['gbps']:5.0f}" if "us" in v else f"{'-':>8} {'-':>5}"

    print(f"{'shape':8} {'M':>5} | {'bf16 us  GB/s':>14} | {'w8a8 us  GB/s':>14} | "
          f"{'wo us  GB/s':>14} | best swept launch")
    for r in rows:
        swept = [(v["us"], key) for key, v in r.items()
                 if key.startswith("wo[") and isinstance(v, dict) and "us" in v]
        best = min(swept) if swept else None
        tail = f"{best[0]:8.1f} {r[best[1]]['gbps']:5.0f} {best[1]}" if best else ""
        print(f"{r['shape']:8} {r['m']:5} | {cell(r, 'bf16')} | {cell(r, 'fused_w8a8')} | "
              f"{cell(r, 'weight_only')} | {tail}")
    # the decode crossover: per M, the four shapes' summed time of each path
    print("per-M sum over shapes (us): M  bf16  w8a8  weight_only  best_swept")
    for m in sorted({r["m"] for r in rows}):
        rs = [r for r in rows if r["m"] == m]

        def tot(key, rs=rs):
            vals = [r.get(key, {}).get("us") for r in rs]
            return sum(vals) if all(v is not None for v in vals) else float("nan")

        best = sum(min([v["us"] for kk, v in r.items() if kk.startswith("wo[")
                        and isinstance(v, dict) and "us" in v] or [float("nan")]) for r in rs)
        print(f"  {m:5} {tot('bf16'):9.1f} {tot('fused_w8a8'):9.1f} {tot('weight_only'):9.1f} "
              f"{best:9.1f}")


if __name__ == "__main__":
    main()
