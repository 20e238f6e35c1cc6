"""FP8 (e4m3) against bf16 GEMMs on the Llama-3-8B projection shapes, per-token activation
scales x per-output-channel weight scales through ``torch._scaled_mm`` (issue 15's design
check). Prints one JSON: for each (M, shape) the median time of bf16 ``F.linear``, the eager
fp8 path, the fused Triton per-token quantizer + ``_scaled_mm`` (``fused_w8a8_us``), the
Triton weight-only kernel (``weight_only_us``, and each of ``--wo-blocks`` block choices),
and the max relative error of each fp8 path against fp32.

    python bench/fp8_gemm.py --out results/h200-DATE-fp8-gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.model.kernels import triton_fp8  # noqa: E402
from tpserve.model.quant.fp8 import fp8_linear, quantize_per_row  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+",
                    default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192])
    ap.add_argument("--wo-blocks", nargs="*", default=["16,32,256,4", "16,64,128,4",
                                                      "16,16,512,4", "32,64,128,4",
                                                      "64,128,64,8"],
                    help="weight-only BLOCK_M,BLOCK_N,BLOCK_K,num_warps choices to time")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=None, help="the commit measured (else git here)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        wq, ws = quantize_per_row(w)
        ws1 = ws.view(-1)
        for m in a.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            y = fp8_linear(x, wq, ws, None, torch.bfloat16)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            xq, xs = quantize_per_row(x)
            t_bf16 = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            t_fp8 = timed(lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws, None, torch.bfloat16))
            t_mm = timed(lambda xq=xq, xs=xs, wq=wq, ws=ws: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16))

            def fused(x=x, wq=wq, ws1=ws1):
                q, s = triton_fp8.quantize_per_token(x)
                return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws1.view(1, -1),
                                        out_dtype=torch.bfloat16)

            t_quant = timed(lambda x=x: triton_fp8.quantize_per_token(x), a.iters)
            t_fused = timed(fused, a.iters)
            err_fused = ((fused().float() - ref).abs().max() / ref.abs().max()).item()
            wo = {}
            for spec in ["default", *a.wo_blocks]:
                blocks = None if spec == "default" else tuple(int(v) for v in spec.split(","))
                try:
                    fn = (lambda x=x, wq=wq, ws1=ws1, blocks=blocks:
                          triton_fp8.weight_only_linear(x, wq, ws1, None, blocks))
                    e = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                    wo[spec] = {"us": timed(fn, a.iters), "max_rel_err": e}
                except Exception as exc:  # noqa: BLE001 - a block choice that does not compile
                    wo[spec] = {"error": repr(exc)[:200]}
            t_wo = wo["default"].get("us")
            rows.append({"shape": name, "m": m, "n": n, "k": k, "bf16_us": t_bf16,
                         "fp8_us": t_fp8, "fp8_gemm_only_us": t_mm,
                         "triton_quant_us": t_quant, "fused_w8a8_us": t_fused,
                         "weight_only_us": t_wo, "weight_only_blocks": wo,
                         "speedup_fused": t_bf16 / t_fused,
                         "speedup_weight_only": t_bf16 / t_wo if t_wo else None,
                         "max_rel_err": err, "max_rel_err_fused": err_fused})
            print(json.dumps(rows[-1]), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": git_commit(a.commit)[0], "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
