"""The RoPE + KV write kernel (``triton_rope``) with and without the Hadamard rotation of q
and K (``--kv-cache-hadamard``), per layer of Llama-3-8B (32 query / 8 KV heads, head dim
128, bf16, FP8 cache, page 16), at a few token counts; timed on the GPU with CUDA graphs of
32 launches (``tune_decode.time_graph``), at several warp counts. (Its first run, at
``be7565d``, also timed the rotation as two tf32 dots against the ±1 matrix, since removed:
``results/h200-2026-12-03-rope-hadamard.json``.)

    python bench/time_rope_hadamard.py --out results/rope-hadamard.json
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

from tpserve.model.kernels import torch_ops, triton_rope  # noqa: E402
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE  # noqa: E402
from tpserve.model.layers.rotary import cos_sin_cache  # noqa: E402

TOKENS = [1, 64, 512, 2048, 8192]
VARIANTS = [("off", False, 4), ("off", False, 8), ("on", True, 4), ("on", True, 8),
            ("on", True, 16)]


def layer_inputs(tokens: int, hq: int, hkv: int, d: int, page: int,
                 cache_dtype: torch.dtype, g: torch.Generator):
    """One layer's RoPE + KV write operands at ``tokens`` tokens, on ``g``'s device: q, k, v
    as views of one bf16 qkv output (as the model produces them), zeroed K/V caches of
    ``cache_dtype`` with a block to spare, positions and slots ``0..tokens-1``."""
    dev = g.device
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev, generator=g,
                      dtype=torch.bfloat16)
    q, k, v = (x.view(tokens, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    kc = torch.zeros(-(-tokens // page) + 1, page, hkv, d, device=dev, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    return q, k, v, kc, vc, torch.arange(tokens, device=dev), torch.arange(tokens, device=dev)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    cs = cos_sin_cache(d, 8192, 500000.0, None).to(dev)
    kv_scale = torch.ones(2, device=dev)
    rows = []
    for t in TOKENS:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, kc, vc, pos, slots = layer_inputs(t, hq, hkv, d, page, FP8_KV_DTYPE, g)
        q0, k0 = q.clone(), k.clone()  # the timed launches rotate q and k in place
        ref_q, _ = torch_ops.rope_and_write_kv(q0.clone(), k0.clone(), v, pos, cs, kc.clone(),
                                               vc.clone(), slots, kv_scale, hadamard=True)
        row = {"tokens": t}
        for name, had, warps in VARIANTS:
            launch = partial(triton_rope.rope_and_write_kv, q, k, v, pos, cs, kc, vc, slots,
                             kv_scale, hadamard=had, num_warps=warps)
            key = f"{name} w{warps}"
            row[key] = {"us": round(time_graph(launch), 2)}
            if had:  # correctness of one fresh launch against the reference
                q2 = q0.clone()
                triton_rope.rope_and_write_kv(q2, k0.clone(), v, pos, cs, kc, vc, slots,
                                              kv_scale, hadamard=True, num_warps=warps)
                row[key]["max_abs_diff_q"] = (q2.float() - ref_q.float()).abs().max().item()
            print(t, key, row[key], flush=True)
        rows.append(row)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
