"""Programmatic dependent launch (PDL) of the Triton kernels (``--pdl``, Hopper and later).

A kernel launched with PDL (``launch_pdl=True``, CUDA's programmatic stream serialization)
may start while the kernel before it on the stream is still running: its programs are placed
on SMs the earlier kernel's last wave leaves free and run until ``griddepcontrol.wait``, which
returns once that kernel has finished and its writes are visible. In a CUDA graph of a
decode step (hundreds of small kernels back to back) this hides most of each launch's ramp-up
behind the previous kernel's tail.

Invariant (what makes it safe): a kernel launched with PDL calls ``pdl_enter`` before its
first global load or store. ``pdl_enter`` first lets the next kernel launch
(``griddepcontrol.launch_dependents``), then waits for the previous one. Since every kernel
of the chain waits for its predecessor before touching memory, a kernel that passes its wait
sees every earlier kernel finished, however far back (a kernel finishes only after its own
wait returned). Kernels launched without PDL (cuBLAS, torch, NCCL) keep the full
serialization on both sides.

The flag is resolved once at start-up (``RunnerConfig.pdl``, ``kernels.backend.resolve_pdl``)
and handed to the op bundle, the attention back-end and the fp8 linear method, which pass it to every
launch; the kernels' own default is off, and off CUDA (the interpreter) it is always off.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The first statement of every kernel that may be launched with PDL: let the next
    kernel launch, then wait until the previous one has finished (both no-ops without PDL;
    compiled out when ``PDL`` is false, as in the interpreter, which has no such
    instructions)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
