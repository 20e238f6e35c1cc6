"""Compiles the WNA16 kernels' launches for Hopper (sm_90) on a machine without a GPU:
``python -m tests.model.hopper_compile`` (``test_hopper_compile.py`` runs it).

Triton's interpreter, which the CPU tests use, runs only the constexpr branches a launch
takes, so an error that only the compiler sees (two return types in one function, say)
reaches the GPU unseen. Triton compiles for a target without the device (front end, LLVM,
``ptxas`` from its wheel), so this script calls the real launch wrappers with CPU tensors,
every ``JITFunction.run`` compiling its launch for ``TARGET`` instead of running it, and
the wrappers' device-dependent choices (``dot_config``, ``_numerics``) made as on CUDA.
It prints one JSON line: the launches compiled, by kernel. Must run without
``TRITON_INTERPRET`` (it is removed before Triton is imported).
"""

from __future__ import annotations

import collections
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tests.model.wna16_operands import operands  # noqa: E402
from tpserve.model.kernels import triton_wna16  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTEE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
           torch.int32: "i32", torch.int64: "i64"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
SHARED_MAX = 232_448  # bytes of shared memory a block may use on sm_90 (227 KiB)


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict) -> None:
    """Compiles ``fn`` for ``TARGET`` as a launch with these arguments would be."""
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for p in fn.params:
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + POINTEE[value.dtype]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET,
                            options=options)
    # the launch, not the compiler, refuses more shared memory than an SM gives a block
    # (OutOfResources): round 31's fp32 per-column tiles of 64 x 128 asked for 238,080
    # the transposed product exists for this: sm_90's wgmma, its first operand (the
    # dequantized weight) in registers
    assert not constexprs.get("SWAP") or "ttng.warp_group_dot" in kernel.asm["ttgir"], (
        f"{fn.__name__} {constexprs} {options}: no wgmma")
    assert kernel.metadata.shared <= SHARED_MAX, (
        f"{fn.__name__} {constexprs} {options}: {kernel.metadata.shared} bytes of shared "
        f"memory, sm_90 gives a block {SHARED_MAX}")


def main() -> int:
    compiled: collections.Counter[str] = collections.Counter()

    def run(self, *args, grid, warmup, **kwargs):
        compile_launch(self, args, kwargs)
        compiled[self.__name__] += 1

    JITFunction.run = run
    numerics, dot_config = triton_wna16._numerics, triton_wna16.dot_config
    triton_wna16._numerics = lambda dtype, device, offset: numerics(dtype, CUDA, offset)
    triton_wna16.dot_config = lambda dtype, device: dot_config(dtype, CUDA)
    code_pairs = triton_wna16._code_pairs
    triton_wna16._code_pairs = lambda kind, bm, dtype, device, offset, scales: code_pairs(
        kind, bm, dtype, CUDA, offset, scales)
    n = 256
    gemv = triton_wna16.wna16_blocks(1, n, 384, 132, torch.float16).block_m == 1
    OTHER_DECODE = "wna16,16,64,128,0,4,3" if gemv else "wna16,1,64,128,0,4,3"  # noqa: N806
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bits in (4, 8):
            # scale rows per K step, per packed row (groups of 32), per column, act-order
            # sorted (perm); M = 1 (split K; the shipped launch and the other of GEMV and
            # 16-row dot), 33, 170 (dequantized, then cuBLAS); K = 384 a whole number of
            # K steps, 320 not
            for layout, group in (("grouped", 128), ("grouped", 32), ("columns", 128),
                                  ("act-order", 128)):
                for m, k, config in ((1, 384, None), (1, 384, OTHER_DECODE), (33, 320, None),
                                     (170, 384, None)):
                    x, *weight, perm, runs = operands(m, n, k, bits, dtype, 0, layout, group)
                    triton_wna16.wna16_matmul(x, *weight, bits, torch.zeros(n, dtype=dtype),
                                              config, perm=perm, runs=runs)
        # float offsets (GGUF's Q4_1: 4 bits, groups of 32): the GEMV, a 33-row tile, the
        # dequantized weight
        for m, k in ((1, 384), (33, 320), (170, 384)):
            x, *weight, perm, runs = operands(m, n, k, 4, dtype, 0, "grouped", 32)
            triton_wna16.wna16_matmul(x, *weight, 4, None, perm=perm, runs=runs, offset=True)
        # GGUF's K-quant forms in groups of 16: 8-bit codes with float offsets (a Q4_K_M
        # q/k/v whose v is Q6_K) and with a zero point (Q6_K alone), 4-bit ones likewise
        # (Q2_K; Q3_K)
        for bits in (8, 4):
            for offset in (True, False):
                for m, k in ((1, 384), (33, 320), (170, 384)):
                    x, *weight, perm, runs = operands(m, n, k, bits, dtype, 0, "grouped", 16)
                    triton_wna16.wna16_matmul(x, *weight, bits, None, perm=perm, runs=runs,
                                              offset=offset)
    # the transposed product ("wna16t"; the default at 2-32 rows over 16 x 128 and 32 x 128
    # tiles): 16-, 32- and 64-row tiles in fp16 / bf16 over K-step and act-order scales,
    # each a wgmma with the weight from registers
    for dtype in (torch.float16, torch.bfloat16):
        for layout in ("grouped", "act-order"):
            for config in ("wna16t,16,64,128,1,4,3", "wna16t,64,128,128,1,4,3",
                           "wna16t,16,128,128,1,4,3", "wna16t,32,128,128,1,4,3"):
                x, *weight, perm, runs = operands(33, n, 384, 4, dtype, 0, layout, 128)
                triton_wna16.wna16_matmul(x, *weight, 4, None, config, perm=perm, runs=runs)
    # the fp16 GEMV with code pairs by PTX ("wna16p"): 4 and 8 bits, scales per K step,
    # per packed row and act-order sorted, split over K
    for bits in (4, 8):
        for layout, group in (("grouped", 128), ("grouped", 32), ("act-order", 128)):
            x, *weight, perm, runs = operands(1, n, 384, bits, torch.float16, 0, layout, group)
            triton_wna16.wna16_matmul(x, *weight, bits, None, "wna16p,1,128,128,3,4,3",
                                      perm=perm, runs=runs)
    print(json.dumps(dict(compiled)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
