"""The decode-attention kernel (or, with ``--w8a8``, the W8A8 GEMM) compiled for sm_90a on
a machine without a GPU: registers, shared memory and an opcode histogram of its SASS, per
launch (how round 5 found the e4m3 V tile read one byte per load, and round 16 the wgmma
waits of the promoted W8A8 steps; ``bench/README.md``).

Triton's NVIDIA backend compiles to a cubin without a device (its wheel carries ``ptxas``
and ``cuobjdump``). Use the Triton version of the GPU machine (3.6.0 with its torch 2.11):
passes differ between versions. Integer arguments get ``tt.divisibility = 16``, as the JIT
specializes them at run time; without it every load is scalar.

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0 numpy
    PYTHONPATH=. /tmp/t36/bin/python bench/offline_sass.py --cache fp8 --launch 32,1,3 --scale-v
    PYTHONPATH=. /tmp/t36/bin/python bench/offline_sass.py --w8a8 64,128,128,4,4 --fast
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpserve.model.kernels.triton_decode_attention import (  # noqa: E402
    LAZY_TAU,
    _decode_split_kernel,
)
from tpserve.model.kernels.triton_w8a8 import _w8a8_kernel  # noqa: E402

POINTERS = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr",
            "part_out_ptr", "part_max_ptr", "part_sum_ptr"]
STRIDES = ["stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_kb", "stride_ko",
           "stride_kh", "stride_vb", "stride_vo", "stride_vh", "stride_bt"]


def compile_sm90a(fn, sig: dict, const: dict, num_warps: int, num_stages: int):
    """``fn`` compiled for sm_90a: ``sig`` the runtime arguments' types, ``const`` the
    constexprs; every pointer and integer argument gets ``tt.divisibility = 16``, as the JIT
    specializes them at run time."""
    sig = sig | {k: "constexpr" for k in const}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t not in ("constexpr", "fp32")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_decode(fp8: bool, block_n: int, num_warps: int, num_stages: int, scale_v: bool,
                   splits: int, group: int = 4, num_kv_heads: int = 8, lazy: bool = False,
                   bt_ahead: bool = False, window: int = 0):
    """``_decode_split_kernel`` for a bf16 q over a bf16 or e4m3 cache (Llama-3-8B's heads);
    ``window``: a sliding window (0: none)."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = ["*bf16", kv, kv, "*i32", "*i32", "*bf16", "*fp32", "*fp32", "*fp32"]
    sig = dict(zip(POINTERS, types, strict=True)) | {"scale_log2": "fp32", "kv_scale_ptr": "*fp32"}
    sig |= {s: "i32" for s in STRIDES}
    const = {"GROUP": group, "BLOCK_G": max(16, triton.next_power_of_2(group)), "HEAD_DIM": 128,
             "BLOCK_D": 128,
             "PAGE_SIZE": 16, "BLOCK_N": block_n, "NUM_SPLITS": splits,
             "DOT_DTYPE": tl.float16 if fp8 else tl.bfloat16, "DOT_PRECISION": "ieee",
             "KV_FP8": fp8, "FP16_DOT": fp8, "LATE_WIDEN": False, "SWAP_QK": False,
             "HEADS_FIRST": False, "NUM_KV_HEADS": num_kv_heads, "SCALE_V": fp8 and scale_v,
             "LAZY": lazy, "TAU": LAZY_TAU, "BT_AHEAD": bt_ahead, "WINDOW": window,
             "SOFTCAP": 0.0}
    return compile_sm90a(_decode_split_kernel, sig, const, num_warps, num_stages)


def compile_w8a8(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                 fast: bool):
    """``_w8a8_kernel`` (e4m3 operands, bf16 output, split partials) as the GPU runs it;
    ``fast``: the K chunk summed in the tensor cores (round 16)."""
    sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
           "b_ptr": "*fp32", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "K_CHUNK": "i32", "stride_x": "i32", "stride_w": "i32", "stride_y": "i32"}
    const = {"HAS_BIAS": False, "EVEN_K": True, "PARTIAL": True, "WIDEN": False,
             "PROMOTE": min(block_k, 128), "FAST": fast, "BLOCK_M": block_m,
             "BLOCK_N": block_n, "BLOCK_K": block_k}
    return compile_sm90a(_w8a8_kernel, sig, const, num_warps, num_stages)


def sass_report(cubin: bytes, top: int) -> dict:
    """Registers per thread and the ``top`` most frequent SASS opcodes of a cubin."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_.]+)", sass, re.M))
    regs = re.search(r"REG:(\d+)", usage)
    return {"registers": int(regs[1]) if regs else None, "opcodes": dict(ops.most_common(top)),
            "sass": sass,
            "LDS.U8": ops.get("LDS.U8", 0), "BAR.SYNC": ops.get("BAR.SYNC.DEFER_BLOCKING", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--launch", default="32,1,3", help="block_n,num_warps,num_stages")
    p.add_argument("--scale-v", action="store_true", help="the V scale in the V tile")
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--lazy-rescale", action="store_true", help="DecodeLaunch.lazy_rescale")
    p.add_argument("--bt-ahead", action="store_true", help="DecodeLaunch.bt_ahead")
    p.add_argument("--window", type=int, default=0, help="a sliding window (0: none)")
    p.add_argument("--w8a8", metavar="BM,BN,BK,WARPS,STAGES",
                   help="compile the W8A8 GEMM with this launch instead")
    p.add_argument("--fast", action="store_true", help="--w8a8 with fast accumulation")
    p.add_argument("--dump", help="write the SASS here")
    a = p.parse_args()
    if a.w8a8:
        c = compile_w8a8(*(int(v) for v in a.w8a8.split(",")), fast=a.fast)
        rep = sass_report(c.asm["cubin"], a.top)
        print(f"triton {triton.__version__}, w8a8 {a.w8a8}, fast {a.fast}: "
              f"{rep['registers']} registers, {c.metadata.shared} B shared")
    else:
        block_n, warps, stages = (int(v) for v in a.launch.split(","))
        c = compile_decode(a.cache == "fp8", block_n, warps, stages, a.scale_v, a.splits,
                           lazy=a.lazy_rescale, bt_ahead=a.bt_ahead, window=a.window)
        rep = sass_report(c.asm["cubin"], a.top)
        print(f"triton {triton.__version__}, {a.cache} cache, launch {a.launch}, scale_v "
              f"{a.scale_v}: {rep['registers']} registers, {c.metadata.shared} B shared, "
              f"LDS.U8 {rep['LDS.U8']}, BAR.SYNC {rep['BAR.SYNC']}")
    for op, n in rep["opcodes"].items():
        print(f"  {n:6d} {op}")
    waits = re.findall(r"((?:WARPGROUP\.)?DEPBAR\.LE (?:SB\d|gsb\d), 0x[0-9a-f]+)", rep["sass"])
    print("  cp.async / wgmma waits:", collections.Counter(waits).most_common())
    if a.dump:
        Path(a.dump).write_text(rep["sass"])


if __name__ == "__main__":
    main()
