"""Programmatic dependent launch (PDL) of the Triton kernels (``--pdl``, Hopper and later).

A kernel launched with PDL (``launch_pdl=True``, CUDA's programmatic stream serialization)
may start while the kernel before it on the stream is still running: its programs are placed
on SMs the earlier kernel's last wave leaves free and run until ``griddepcontrol.wait``, which
returns once that kernel has finished and its writes are visible. In a CUDA graph of a
decode step (hundreds of small kernels back to back) this hides most of each launch's ramp-up
behind the previous kernel's tail.

Invariant (what makes it safe): a kernel launched with PDL calls ``pdl_enter`` (or
``pdl_release`` ... ``pdl_wait``) before its first global load or store. It first lets the
next kernel launch (``griddepcontrol.launch_dependents``), then waits for the previous one.
Since every kernel of the chain waits for its predecessor before touching memory, a kernel
that passes its wait sees every earlier kernel finished, however far back (a kernel finishes
only after its own wait returned). Kernels launched without PDL (cuBLAS, torch, NCCL) keep
the full serialization on both sides. Between release and wait a kernel may only *prefetch*
into L2 (``prefetch_l2``) memory that no kernel of the step writes, such as its weights: a
prefetch writes no register, and a line a later kernel wrote would be read after the wait
from L2, where the write went.

The flag is resolved once at start-up (``RunnerConfig.pdl``, ``kernels.backend.resolve_pdl``)
and handed to the op bundle, the attention back-end and the fp8 linear method, which pass it to every
launch; the kernels' own default is off, and off CUDA (the interpreter) it is always off.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Lets the next kernel on the stream launch (no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Waits until the previous kernel has finished and its writes are visible (no-op
    without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Asks L2 for the lines at the pointers ``ptrs`` (any shape; one ``prefetch.global.L2``
    each; nothing is loaded into registers). GPU only: the interpreter cannot run it."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(rows, k_lo, K_CHUNK, PREFETCH_K: tl.constexpr):
    """``prefetch_l2`` of bytes ``k_lo .. k_lo + min(PREFETCH_K, K_CHUNK)`` of the rows whose
    starts are the pointers ``rows`` (``[R]``, 1-byte elements: fp8 weights), one 128-byte
    line per prefetch, as one ``[R, PREFETCH_K / 128]`` tile (never past ``K_CHUNK``)."""
    cols = tl.minimum(tl.arange(0, PREFETCH_K // 128) * 128, K_CHUNK - 1)
    prefetch_l2(rows[:, None] + k_lo + cols[None, :])


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of every kernel that may be launched with PDL: let the next
    kernel launch, then wait until the previous one has finished (both no-ops without PDL;
    compiled out when ``PDL`` is false, as in the interpreter, which has no such
    instructions)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
