"""Block-wise FP8 products against per-channel FP8 on the Llama-3-8B projection shapes, timed
inside CUDA graphs (``fp8_gemm.py``'s ``graph_us``: ``--calls`` back-to-back calls over
weight copies of >= 256 MiB, the median of ``--replays`` replays).

For each shape (qkv, o, gate_up, down) and M, the product as the served layer takes it,
activation quantization included:
- ``channel``: ``--quantization fp8`` (``Fp8LinearMethod``, per-channel weight scales);
- ``block``: a ``[128, 128]`` block-wise checkpoint's layer as served (``Fp8BlockMethod``
  at the default ``--fp8-weight-only-max-tokens``: the tuned weight-only launches with
  block scales up to it, the Triton block GEMM up to 64 tokens, cuBLAS's block scaling
  above where ``block_mm_supported``);
- ``block_kernel``: the Triton block GEMM at every M (weight-only up to the default), as
  served before round 19;
- ``cublas_block`` (M > 32): the group quantizer, then ``cublas_block_product``
  (``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` activations and
  ``BlockWise128x128`` weights: cuBLAS on Hopper, CUDA >= 12.9).
Each variant's max |difference| from the Triton block GEMM is recorded; an error (no such
kernel) is recorded as the error's first line. ``--sweep``: at ``SWEEP_M`` also the Triton
block GEMM alone (activations quantized beforehand, as the norms and the SiLU gate hand
them over) with its default launch (``sweep_default``) and each of ``SWEEP_LAUNCHES``
(``BlockLaunch`` strings: rows, columns, split, warps, stages), or of ``--launches`` at
``--sweep-m``.

    python bench/fp8_block_gemm.py --out results/h200-DATE-fp8-block-gemm.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemm import SHAPES, copies_for, graph_us  # noqa: E402  (bench/fp8_gemm.py)
from make_fp8_checkpoint import block_tensors  # noqa: E402  (bench/make_fp8_checkpoint.py)
from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.model.kernels import triton_fp8_block, triton_fp8_quant  # noqa: E402
from tpserve.model.quant.fp8 import Fp8LinearMethod, quantize_per_row  # noqa: E402
from tpserve.model.quant.fp8_block import (  # noqa: E402
    Fp8BlockMethod,
    block_mm_supported,
    cublas_block_product,
)

M_VALUES = [1, 2, 8, 16, 32, 48, 64, 128, 256, 512, 2048]
BLOCK = (128, 128)
# the Triton block GEMM's W8A8 steps (33-64 tokens): launches around tiles()' choice
SWEEP_M = (48, 64)
SWEEP_LAUNCHES = ["64,64,1,4,3", "64,64,2,4,3", "64,64,3,4,3", "64,64,2,4,4", "64,64,2,8,3",
                  "64,64,4,4,3", "64,128,1,8,3", "64,128,2,8,3", "64,128,2,4,3",
                  "64,32,1,4,3", "64,32,2,4,3", "64,32,4,4,3", "32,64,2,4,3", "64,64,2,4,2"]


class Layer:
    """The attributes the quant methods' ``apply`` reads."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int = 1):
        self.weight, self.weight_scale, self.weight_scale_rows = weight, scale, scale_rows


def variants_for(x, c_layers, b_layers, channel, block, w8a8: bool) -> dict:
    """Per variant, ``make(i)``: a call of it on weight copy ``i`` (cycling)."""
    nc = len(c_layers)

    def on(layers, fn):
        return lambda i: (lambda L=layers[i % nc]: fn(L))

    out = {"channel": on(c_layers, lambda L: channel.apply(L, x, None)),
           "block": on(b_layers, lambda L: block.apply(L, x, None)),
           "block_kernel": on(b_layers, lambda L: triton_fp8_block.block_gemm(
               x, L.weight, L.weight_scale, 128, BLOCK[1], None, w8a8))}
    if w8a8:
        out["cublas_block"] = on(b_layers, lambda L: cublas_block_product(
            *triton_fp8_quant.quantize_per_group(x, BLOCK[1]), L.weight, L.weight_scale, None,
            torch.bfloat16))
    return out


def sweep(x: torch.Tensor, b_layers: list, calls: int, replays: int, want: torch.Tensor,
          launches: list[str]) -> dict:
    """µs and max |difference| of the Triton block GEMM on pre-quantized ``x``: its default
    launch and each of ``launches`` (``BlockLaunch`` strings)."""
    xq, xs = triton_fp8_quant.quantize_per_group(x, BLOCK[1])
    nc = len(b_layers)
    out = {}
    for spec in ["default", *launches]:
        launch = None if spec == "default" else triton_fp8_block.BlockLaunch.parse(spec)

        def make(i, launch=launch):
            L = b_layers[i % nc]
            return lambda: triton_fp8_block.block_gemm(
                xq, L.weight, L.weight_scale, 128, BLOCK[1], None, True, xs, x.dtype, launch)

        try:
            diff = float((make(0)().float() - want).abs().max())
            out[spec] = {"us": round(graph_us([make(i) for i in range(calls)], replays), 2),
                         "max_diff": diff}
        except Exception as e:  # noqa: BLE001 (a launch that does not compile or fit: recorded)
            out[spec] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=M_VALUES)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP_LAUNCHES")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=list(SWEEP_M))
    ap.add_argument("--launches", nargs="+", default=SWEEP_LAUNCHES,
                    help="the sweep's launches (default SWEEP_LAUNCHES)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit measured (else git here)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    channel = Fp8LinearMethod("triton", scaled_mm=True)
    block = Fp8BlockMethod("triton", scaled_mm=True, block=BLOCK,
                           block_mm=block_mm_supported(dev))
    rows = []
    for name in a.shapes:
        n, k = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        cq, cs = quantize_per_row(w)
        # block scales: each [128, 128] block's amax / 448, as the bench checkpoints have them
        stored = block_tensors("w", w, BLOCK)
        bq, bs = stored["w"].to(dev), stored["w_scale_inv"].to(dev)
        nc = copies_for(n * k, a.rotate_mib, a.calls)
        c_layers = [Layer(cq.clone(), cs.view(-1).clone()) for _ in range(nc)]
        b_layers = [Layer(bq.clone(), bs.clone(), 128) for _ in range(nc)]
        for m in a.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            row = {"shape": name, "n": n, "k": k, "m": m}
            w8a8 = block.uses_w8a8(m, bq)
            variants = variants_for(x, c_layers, b_layers, channel, block, w8a8)
            want = triton_fp8_block.block_gemm(x, bq, bs, 128, BLOCK[1], None, w8a8).float()
            for key, make in variants.items():
                try:
                    got = make(0)().float()
                    row[key + "_max_diff"] = float((got - want).abs().max())
                    row[key + "_us"] = round(graph_us([make(i) for i in range(a.calls)],
                                                      a.replays), 2)
                except (RuntimeError, NotImplementedError) as e:
                    row[key + "_error"] = str(e).splitlines()[0][:300]
            if a.sweep and m in a.sweep_m:
                row["sweep"] = sweep(x, b_layers, a.calls, a.replays, want, a.launches)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print_table(rows, a.m)
    if a.out:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "block_mm": block.block_mm,
                  "cuda": torch.version.cuda, "commit": a.commit or git_commit(),
                  "method": __doc__.split("\n\n")[0], "rows": rows}
        Path(a.out).write_text(json.dumps(result, indent=1))


def print_table(rows: list[dict], ms: list[int]) -> None:
    """Per M, the four shapes' times summed (one layer's products), each variant."""
    keys = ("channel", "block", "block_kernel", "cublas_block")
    print("M".rjust(6) + "".join(k.rjust(14) for k in keys))
    for m in ms:
        rs = [r for r in rows if r["m"] == m]
        cells = []
        for key in keys:
            us = [r.get(key + "_us") for r in rs]
            cells.append(f"{sum(us):.1f}" if us and None not in us else "-")
        print(str(m).rjust(6) + "".join(c.rjust(14) for c in cells))


if __name__ == "__main__":
    main()
