"""Registers, spills and shared memory of the RoPE + KV write kernel's compiled variants
(bf16 or FP8 cache, with or without the fused q/k head norm, 4 or 8 warps), Qwen3-8B's
layer shape, into OUT/regs.json, and the TTGIR of each as OUT/INDEX.ttgir for reading the
layouts (round 23).

    python bench/rope_kernel_regs.py --out results/rope-regs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpserve.model.kernels import triton_rope  # noqa: E402
from tpserve.model.kernels.torch_ops import HeadNorm  # noqa: E402
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE  # noqa: E402
from tpserve.model.layers.rotary import cos_sin_cache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    hq, hkv, d, t = 32, 8, 128, 64
    cs = cos_sin_cache(d, 256, 1e6, None).to(dev)
    norm = HeadNorm(torch.ones(d, device=dev, dtype=torch.bfloat16),
                    torch.ones(d, device=dev, dtype=torch.bfloat16), 1e-6)
    names = []  # launch order, which is the kernel cache's order
    for cache_dtype in (torch.bfloat16, FP8_KV_DTYPE):
        for head_norm in (None, norm):
            for warps in (4, 8):
                names.append(f"{str(cache_dtype).removeprefix('torch.')} "
                             f"{'norm' if head_norm is not None else 'plain'} w{warps}")
                qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
                q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
                kc = torch.zeros(8, 16, hkv, d, device=dev, dtype=cache_dtype)
                triton_rope.rope_and_write_kv(q, k, v, torch.arange(t, device=dev), cs, kc,
                                              kc.clone(), torch.arange(t, device=dev),
                                              torch.ones(2, device=dev), head_norm=head_norm,
                                              num_warps=warps)
    torch.cuda.synchronize()
    rows = []
    for i, ck in enumerate(triton_rope._rope_write_kv_kernel.device_caches[0][0].values()):
        row = {"index": i, "variant": names[i], "n_regs": ck.n_regs, "n_spills": ck.n_spills,
               "shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps}
        (out / f"{i}.ttgir").write_text(ck.asm["ttgir"])
        print(row, flush=True)
        rows.append(row)
    (out / "regs.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
