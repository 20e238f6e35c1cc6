"""Qwen3's q/k head RMSNorm: fused into the RoPE + KV write kernel (``triton_rope``,
``head_norm``) against the same work unfused (two Triton RMSNorm launches over the q and k
heads, then the plain RoPE + KV write) and against RoPE alone, per layer of Qwen3-8B (32
query / 8 KV heads, head dim 128, bf16; a bf16 and an FP8 cache, page 16), at a few token
counts, the fused launch also at each warp count; timed on the GPU with CUDA graphs of 32
launches (``tune_decode.time_graph``). Each fused launch is also checked against the torch
reference once.

    python bench/time_rope_head_norm.py --out results/rope-head-norm.json
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from time_rope_hadamard import layer_inputs  # noqa: E402
from tune_decode import time_graph, write_rows  # noqa: E402

from tpserve.model.kernels import torch_ops, triton_norm, triton_rope  # noqa: E402
from tpserve.model.kernels.torch_ops import HeadNorm  # noqa: E402
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE  # noqa: E402
from tpserve.model.layers.rotary import cos_sin_cache  # noqa: E402

TOKENS = [1, 64, 512, 2048, 8192]
WARPS = [1, 2, 4, 8, 16]  # the fused launch's num_warps, beside the default


def _unfused(q, k, v, pos, cs, kc, vc, slots, kv_scale, norm: HeadNorm) -> None:
    qn = triton_norm.rms_norm(q, norm.q_weight, norm.eps)
    kn = triton_norm.rms_norm(k, norm.k_weight, norm.eps)
    triton_rope.rope_and_write_kv(qn, kn, v, pos, cs, kc, vc, slots, kv_scale)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d, page = 32, 8, 128, 16
    cs = cos_sin_cache(d, 8192, 1000000.0, None).to(dev)
    kv_scale = torch.ones(2, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    norm = HeadNorm(1 + 0.2 * torch.randn(d, device=dev, generator=g).bfloat16(),
                    1 + 0.2 * torch.randn(d, device=dev, generator=g).bfloat16(), 1e-6)
    rows = []
    for t in TOKENS:
        for cache_dtype in (torch.bfloat16, FP8_KV_DTYPE):
            q, k, v, kc, vc, pos, slots = layer_inputs(t, hq, hkv, d, page, cache_dtype, g)
            q0, k0 = q.clone(), k.clone()  # the timed launches change q and k in place
            ref_q, _ = torch_ops.rope_and_write_kv(q0.clone(), k0.clone(), v, pos, cs,
                                                   kc.clone(), vc.clone(), slots, kv_scale,
                                                   head_norm=norm)
            args = (q, k, v, pos, cs, kc, vc, slots, kv_scale)
            row = {"tokens": t, "cache": str(cache_dtype).removeprefix("torch.")}
            for name, launch in [
                    ("rope only", partial(triton_rope.rope_and_write_kv, *args)),
                    ("fused norm", partial(triton_rope.rope_and_write_kv, *args,
                                           head_norm=norm)),
                    ("unfused norm", partial(_unfused, *args, norm)),
                    *((f"fused norm w{w}", partial(triton_rope.rope_and_write_kv, *args,
                                                   head_norm=norm, num_warps=w))
                      for w in WARPS)]:
                row[name] = {"us": round(time_graph(launch), 2)}
            q2 = q0.clone()
            triton_rope.rope_and_write_kv(q2, k0.clone(), v, pos, cs, kc, vc, slots, kv_scale,
                                          head_norm=norm)
            row["fused norm"]["max_abs_diff_q"] = (q2.float() - ref_q.float()).abs().max().item()
            print(row, flush=True)
            rows.append(row)
    write_rows(a.out, rows)


if __name__ == "__main__":
    main()
