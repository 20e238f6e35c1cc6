"""The serving step's heaviest kernels, each launched once between ``cudaProfilerStart`` and
``cudaProfilerStop`` for Nsight Compute (``ncu --profile-from-start off``): where each one
is bound (throughput against the device's peaks, warp stalls, occupancy), to compare with
the graph-timed figures of ``time_kv_layout.py`` and ``fp8_gemm.py``.

Cases, in launch order (the order ``ncu``'s report lists them in):
1. decode attention, 64 sequences x 1,152 keys, Llama-3-8B's layer (32 / 8 heads, D 128),
   bf16 cache, default launch and split count (split kernel, then the reduce);
2. the same over an e4m3 cache, default launch (one-warp programs);
3. the same over e4m3 with ``--fp8-launches`` overrides (e.g. ``w4n64``);
4. the Triton W8A8 GEMM at M = 64 for qkv, o, gate_up, down (kernel + split reduce);
5. ``torch._scaled_mm`` at M = 512, rowwise scales, fast accumulation, same four shapes.

    ncu --clock-control none --profile-from-start off --set full -o rep \\
        python3 bench/ncu_kernels.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from time_decode_bt_ahead import BEFORE_BT_AHEAD  # noqa: E402
from time_kv_layout import make_cache  # noqa: E402
from tune_decode import launch_knobs, scattered_block_table  # noqa: E402

from tpserve.model.kernels.decode_launch import (  # noqa: E402
    FP8_LAUNCH,
    FP8_SMALL_LAUNCH,
    decode_num_splits,
    default_num_splits,
)
from tpserve.model.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tpserve.model.kernels.triton_w8a8 import w8a8_linear  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
FP8_LAUNCHES = {
    "w1n32s3": BEFORE_BT_AHEAD,
    "w1n16s4": FP8_LAUNCH._replace(block_n=16, num_stages=4),
    "w4n64": FP8_LAUNCH._replace(block_n=64, num_warps=4, target_programs=264),
    "w4n128s2": FP8_SMALL_LAUNCH._replace(target_programs=264),
    "w1n32x4": FP8_LAUNCH._replace(target_programs=2048),
}


def decode_cases(batch: int, ctx: int, extra: list[str], dev) -> list[tuple[str, object]]:
    scale = torch.tensor([0.02, 0.01], device=dev)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    nb = batch * (ctx // PAGE)
    table = scattered_block_table([ctx // PAGE] * batch).to(dev)
    caches = make_cache(nb, PAGE, dev, scale)
    out = torch.empty_like(q)
    cases = []
    for dtype in ("bf16", "fp8"):  # the launch order the docstring lists
        kc, vc = caches[dtype]
        launches = [("default", None)] + ([(n, FP8_LAUNCHES[n]) for n in extra]
                                          if dtype == "fp8" else [])
        for name, lc in launches:
            if lc is None:
                n, knobs = default_num_splits(kc.dtype, batch, HKV, ctx), {}
            else:
                n = decode_num_splits(batch, HKV, ctx, lc.target_programs)
                knobs = launch_knobs(lc)

            def fn(kc=kc, vc=vc, n=n, knobs=knobs, fp8=dtype == "fp8"):
                decode_attention(q, kc, vc, table, lens, 0.088, out, n,
                                 kv_scale=scale if fp8 else None, **knobs)
            cases.append((f"decode {dtype} {name} {batch}x{ctx} splits {n}", fn))
    return cases


def gemm_cases(dev) -> list[tuple[str, object]]:
    cases = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(n, device=dev) * 0.01 + 0.001
        for m in (64, 512):
            x = (torch.randn(m, k, device=dev) * 30).to(torch.float8_e4m3fn)
            xs = torch.rand(m, 1, device=dev) * 0.01 + 0.001
            if m == 64:
                def fn(x=x, xs=xs, w=w, ws=ws):
                    w8a8_linear(x, xs, w, ws, None, torch.bfloat16)
                cases.append((f"w8a8 triton {name} M={m}", fn))
            else:
                def fn(x=x, xs=xs, w=w, ws=ws):
                    torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                     out_dtype=torch.bfloat16, use_fast_accum=True)
                cases.append((f"scaled_mm {name} M={m}", fn))
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1152)
    p.add_argument("--fp8-launches", nargs="*", default=list(FP8_LAUNCHES),
                   choices=list(FP8_LAUNCHES))
    p.add_argument("--no-gemm", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda")
    cases = decode_cases(a.batch, a.context, a.fp8_launches, dev)
    if not a.no_gemm:
        cases += gemm_cases(dev)
    for _, fn in cases:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i, (name, fn) in enumerate(cases):
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print(f"case {i}: {name}", flush=True)
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
