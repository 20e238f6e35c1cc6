"""Every kernel of block-wise FP8 checkpoints compiled for sm_90a without a GPU, in the
launches the server makes on dummy llama3-8b (``offline_sass.py``'s method): the block GEMM
(W8A8 and weight-only, each tile shape ``triton_fp8_block.tiles`` picks), the group
quantizer, the norm and SiLU gate with the group quantization fused, and the split
reduction. For each: registers, shared memory, and the tensor-core instructions in its
SASS (``HGMMA``/``QGMMA``: warpgroup MMAs on bf16/fp8; ``HMMA``: the
older per-warp MMAs). A compile error here is one the GPU would raise at the first launch.

    PYTHONPATH=. /tmp/t36/bin/python bench/offline_fp8_block.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_sass import compile_sm90a, sass_report  # noqa: E402  (bench/offline_sass.py)

from tpserve.model.kernels import triton_fp8_block as blk  # noqa: E402
from tpserve.model.kernels import triton_fp8_fused as fused  # noqa: E402
from tpserve.model.kernels import triton_fp8_quant as quant  # noqa: E402
from tpserve.model.kernels.triton_fp8 import _wo_reduce_kernel  # noqa: E402

# (name, N, K) of dummy llama3-8b's linear layers at tp 1
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]
QUANT = dict(FP8_MAX_C=quant.FP8_MAX, INV_FP8_MAX_C=quant.INV_FP8_MAX,
             MIN_SCALE_C=quant.MIN_SCALE, BIT_CAST=False)


def block_gemm(m: int, n: int, k: int, w8a8: bool):
    bm, bn, _ = blk.tiles(m, n, triton.cdiv(k, 128), 132)
    sig = {"x_ptr": "*fp8e4nv" if w8a8 else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
           "ws_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "GROUPS_PER_SPLIT": "i32", "stride_x": "i32", "stride_xs": "i32",
           "stride_w": "i32", "stride_ws": "i32", "stride_y": "i32"}
    const = {"SCALE_ROWS": 128, "QUANT_X": w8a8, "IEEE": False, "HAS_BIAS": False,
             "BLOCK_M": bm, "BLOCK_N": bn, "GROUP": 128}
    warps = 4 if bm * bn <= 64 * 64 else 8
    return f"block GEMM {'w8a8' if w8a8 else 'weight-only'} {bm}x{bn}", compile_sm90a(
        blk._block_kernel, sig, const, warps, 3)


def kernels():
    """``(label, compiled)`` for every launch."""
    for m in (1, 64, 512):
        for w8a8 in ((False, True) if m <= 32 else (True,)):
            seen = set()
            for _, n, k in SHAPES:
                label, c = block_gemm(m, n, k, w8a8)
                if label not in seen:
                    seen.add(label)
                    yield f"M={m} {label}", c
    yield "group quantizer", compile_sm90a(
        quant._quant_per_group_kernel,
        {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32",
         "stride_q": "i32", "stride_s": "i32"}, QUANT | {"GROUP": 128}, 4, 1)
    norm_sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*u8",
                "s_ptr": "*fp32", "sum_ptr": "*bf16", "static_ptr": "*fp32",
                "stride_x": "i32", "stride_r": "i32", "stride_q": "i32", "stride_s": "i32",
                "stride_sc": "i32", "hidden": "i32", "eps": "fp32"}
    yield "RMSNorm + residual, group-quantized", compile_sm90a(
        fused._rms_norm_fp8_kernel, norm_sig,
        QUANT | {"OUT_DTYPE": triton.language.bfloat16, "HAS_RESIDUAL": True,
                 "STATIC": False, "GROUP": 128, "BLOCK_H": 4096}, 8, 1)
    silu_sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "static_ptr": "*fp32",
                "stride_x": "i32", "stride_q": "i32", "stride_sc": "i32", "d": "i32"}
    for block, one_pass, warps in ((16384, True, 16), (2048, False, 8)):
        yield f"SiLU gate, group-quantized, block {block}", compile_sm90a(
            fused._silu_and_mul_fp8_kernel, silu_sig,
            QUANT | {"STATIC": False, "GROUP": 128, "BLOCK": block, "ONE_PASS": one_pass},
            warps, 1)
    yield "split reduction, no weight scale", compile_sm90a(
        _wo_reduce_kernel,
        {"p_ptr": "*fp32", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32",
         "N": "i32", "SPLIT": "i32", "stride_y": "i32"},
        {"HAS_SCALE": False, "HAS_BIAS": True, "BLOCK": 1024}, 4, 1)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    for label, c in kernels():
        rep = sass_report(c.asm["cubin"], 0)
        mma = {op: len(re.findall(rf"\b{op}\b", rep["sass"]))
               for op in ("HGMMA", "QGMMA", "HMMA")}
        print(f"{label:45s} {rep['registers']:4d} registers, {c.metadata.shared:6d} B shared, "
              f"mma {', '.join(f'{k} {v}' for k, v in mma.items() if v) or 'none'}")


if __name__ == "__main__":
    main()
