"""A mixture of experts' grouped products on the GPU: ``torch._grouped_mm`` (the torch ops,
CUTLASS on Hopper) against the Triton kernel (``triton_moe.grouped_mm``, any dtype) in
bf16, per expert layer of Qwen3-30B-A3B (128 experts of 768 columns, 8 per token, hidden
2,048) and Mixtral-8x7B (8 of 14,336, 2 per token, hidden 4,096), at several token counts
with uniform random routing: each product alone (gate/up, then down) and the whole
``ParallelExperts.forward`` (sort, gather, products, SiLU gate, weighted sum), timed as
CUDA-graph replays (``tune_decode.time_graph``), with the weight bytes the step touches
over the time and the largest difference between the two paths; and the Triton path over
the same experts quantized to fp8 (``--quantization fp8``: weight-only, half the bytes);
and the Triton gate/up product at other tiles (``SWEEP``).

    python bench/time_moe.py --out results/moe.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_decode import time_graph, write_rows  # noqa: E402

from tpserve.model.kernels import torch_ops, triton_activation, triton_moe  # noqa: E402
from tpserve.model.layers.moe import route  # noqa: E402
from tpserve.model.quant.fp8 import Fp8LinearMethod  # noqa: E402
from tpserve.parallel.comm import Communicator  # noqa: E402
from tpserve.parallel.moe import ParallelExperts  # noqa: E402
from tpserve.parallel.state import TPGroup  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = [1, 8, 64, 256, 1024, 8192]
PATHS = {"torch": torch_ops.grouped_mm, "triton": triton_moe.grouped_mm}
# other (BLOCK_M, BLOCK_N, BLOCK_K, warps) launches of the gate/up product: [large, small]
SWEEP = [[(64, 128, 64, 8), (128, 128, 64, 8), (64, 256, 64, 8), (128, 256, 64, 8)],
         [(16, 32, 128, 4), (16, 128, 64, 4), (16, 64, 256, 4), (16, 32, 256, 2)]]


def measure(experts: ParallelExperts, fp8: ParallelExperts, t: int, k: int,
            g: torch.Generator) -> dict:
    """One row: both paths at ``t`` tokens routed uniformly at random, ``k`` per token, and
    the Triton path over the same experts in fp8 (``fp8``: weight-only, per-row scales)."""
    e, h, width = experts.num_experts, experts.w2.shape[1], experts.w2.shape[2]
    dev = g.device
    x = torch.randn(t, h, device=dev, generator=g, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(t, e, device=dev, generator=g), k, True)
    flat = ids.flatten()
    ends = torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32)
    rows_in = x.index_select(0, torch.argsort(flat, stable=True) // k)
    h1 = torch.randn(t * k, width, device=dev, generator=g, dtype=torch.bfloat16)
    used = ids.unique().numel()
    row = {"tokens": t, "experts_used": used, "weight_bytes": used * 3 * h * width * 2}
    outs = {}
    for name, mm in PATHS.items():
        row[f"{name}_up_us"] = round(time_graph(partial(mm, rows_in, experts.w13, ends)), 2)
        row[f"{name}_down_us"] = round(time_graph(partial(mm, h1, experts.w2, ends)), 2)
        layer = partial(experts, x, ids, weights, triton_activation.silu_and_mul, mm)
        row[f"{name}_layer_us"] = round(time_graph(layer), 2)
        row[f"{name}_layer_TBps"] = round(row["weight_bytes"] / row[f"{name}_layer_us"] / 1e6,
                                          3)
        outs[name] = layer().float()
    row["max_abs_diff"] = (outs["torch"] - outs["triton"]).abs().max().item()
    layer = partial(fp8, x, ids, weights, triton_activation.silu_and_mul, PATHS["triton"])
    row["triton_fp8_layer_us"] = round(time_graph(layer), 2)
    row["triton_fp8_layer_TBps"] = round(row["weight_bytes"] / 2 / row["triton_fp8_layer_us"]
                                         / 1e6, 3)
    row["fp8_max_abs_diff"] = (layer().float() - outs["triton"]).abs().max().item()
    for launch in SWEEP[t <= 64]:  # the gate/up product at other tiles
        row["up_us_" + "x".join(map(str, launch))] = round(time_graph(partial(
            triton_moe.grouped_mm, rows_in, experts.w13, ends, None, launch)), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    comm = Communicator(TPGroup(0, 1, dev, None))
    rows = []
    for shape, (e, k, h, width) in SHAPES.items():
        with torch.device(dev):
            experts = ParallelExperts(e, h, width, comm, torch.bfloat16)
            fp8 = ParallelExperts(e, h, width, comm, torch.bfloat16, Fp8LinearMethod())
        with torch.no_grad():
            for w, w8 in ((experts.w13, fp8.w13), (experts.w2, fp8.w2)):
                w.copy_(torch.randn(w.shape, device=dev, generator=g) * 0.02)
                w8.copy_(w)
        fp8.process_weights_after_loading()
        for t in TOKENS:
            row = {"shape": shape, **measure(experts, fp8, t, k, g)}
            print(row, flush=True)
            rows.append(row)
        del experts, fp8
        torch.cuda.empty_cache()
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
