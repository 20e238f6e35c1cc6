"""The Triton grouped product of a mixture of experts (``triton_moe``) compiled for sm_90a
without a GPU (``offline_sass.py``'s method), in its two launches (``triton_moe._launch``:
16-row tiles up to 256 routed rows, 64-row tiles above), over bf16 experts and over fp8
experts with per-row scales, with Qwen3-30B-A3B's 128 experts: registers, shared memory,
spill stores / loads (``STL`` / ``LDL``) and the tensor-core instructions in its SASS
(``HGMMA``: warpgroup MMAs; ``HMMA``: per-warp MMAs). A compile error here is one the GPU
would raise at the first launch.

    PYTHONPATH=. python bench/offline_moe.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_sass import compile_sm90a, sass_report  # noqa: E402  (bench/offline_sass.py)

from tpserve.model.kernels import triton_moe  # noqa: E402

EXPERTS = 128


def compiled(rows: int, fp8: bool):
    bm, bn, bk, warps = triton_moe._launch(rows, 1536)
    sig = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "out_ptr": "*bf16",
           "ends_ptr": "*i32", "scale_ptr": "*fp32" if fp8 else "*i32", "N": "i32",
           "K": "i32", "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_o": "i32"}
    const = {"E": EXPERTS, "E_PAD": EXPERTS, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
             "DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32", "SCALED": fp8}
    label = f"{bm}x{bn}x{bk}, {warps} warps, {'fp8' if fp8 else 'bf16'} experts"
    return label, compile_sm90a(triton_moe._grouped_mm_kernel, sig, const, warps, 3)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    for rows in (8, 4096):
        for fp8 in (False, True):
            label, c = compiled(rows, fp8)
            rep = sass_report(c.asm["cubin"], 0)
            ops = {op: len(re.findall(rf"\b{op}\b", rep["sass"]))
                   for op in ("HGMMA", "HMMA", "STL", "LDL")}
            print(f"{label:40s} {rep['registers']:4d} registers, {c.metadata.shared:6d} B "
                  f"shared, {', '.join(f'{k} {v}' for k, v in ops.items())}")


if __name__ == "__main__":
    main()
