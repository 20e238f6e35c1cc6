"""Fused rotary embedding + paged KV-cache write as one Triton kernel (see torch_ops).

Layouts:
- ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]``: any token/head strides, unit stride along ``D``
  (views into a fused QKV projection output are fine).
- ``cos_sin_cache [max_positions, R]`` float32, ``R = rotary_dim <= D``: cosines in
  ``[:R/2]``, sines in ``[R/2:]``; rotate-half pairing of element ``i`` with ``i + R/2``.
  Dimensions ``R..D`` pass through unrotated.
- ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``; token ``t`` is written at flat
  slot ``slot_mapping[t]`` unless that slot is negative.

One program handles one token: all its q and k heads are rotated **in place** (rounded to
their dtype as the reference does) and its rotated k and its v are stored to the cache. An
FP8 cache stores ``e4m3(clamp(x / s, ±448))`` with ``s = kv_scale[0]`` for K and
``kv_scale[1]`` for V (device scalars: nothing is read on the host), computed from the
rounded k exactly as ``torch_ops.quantize_kv`` does (``triton_fp8_kv``).

With ``head_norm`` (Qwen3, Gemma 3; RoPE over the whole head) each q and k head is first
RMS-normed over ``D`` in float32 statistics, rounded to its dtype before the weight
multiply and after it, as ``torch_ops.rms_norm`` does (with ``unit_offset``, Gemma's,
multiplied by ``1 + w`` in float32 and rounded once, after it): the norm costs no launch
and no pass over q and k of its own.

With ``hadamard`` (``model/kv_hadamard``; RoPE over the whole head) the rotated q and k
heads, rounded to their dtype, are then multiplied by ``H / sqrt(D)``: with
``H_D = [[H, H], [H, -H]]`` (``H`` Sylvester's of order ``D/2``) the halves become
``((x1 + x2) H, (x1 - x2) H) / sqrt(D)``, each ``. H`` a fast Walsh-Hadamard transform in
float32 (log2(D/2) butterfly stages of reshapes, splits and joins in registers), rounded to
the dtype once more before the store and the cache write. (Two tf32 dots against the ±1
matrix did the same 2.3-4.9x slower: ``bench/time_rope_hadamard.py``.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.torch_ops import HeadNorm
from tpserve.model.kernels.triton_fp8_kv import to_cache
from tpserve.model.kernels.triton_support import FP_FUSION
from tpserve.model.kv_cache_dtype import is_fp8


@triton.jit
def _rotate_half(x1, x2, cos, sin):
    """Rotated halves ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in float32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_weight(w_ptr, offs_r, r_mask, HALF: tl.constexpr):
    """A head norm's weight ``[HEAD_DIM]`` as float32 halves ``[1, HALF]`` (masked: 0)."""
    w1 = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    return w1, w2


@triton.jit
def _head_norm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, UNIT_OFFSET: tl.constexpr = False):
    """The halves ``[ROWS, HALF]`` of each head (a row) RMS-normed over the whole head and
    multiplied by the weight's halves ``w1``, ``w2`` (float32; with ``UNIT_OFFSET``, by
    ``1 + w``), in the halves' dtype (see the module docstring). Masked-off rows and
    columns are zero and stay zero."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)
    if UNIT_OFFSET:  # Gemma: the float32 product, rounded once
        n1 = (a * inv_rms[:, None]) * (1.0 + w1)
        n2 = (b * inv_rms[:, None]) * (1.0 + w2)
    else:
        n1 = (a * inv_rms[:, None]).to(x1.dtype).to(tl.float32) * w1
        n2 = (b * inv_rms[:, None]).to(x1.dtype).to(tl.float32) * w2
    return n1.to(x1.dtype), n2.to(x1.dtype)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, N: tl.constexpr, B: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform of ``x [ROWS, N]``'s rows: elements
    ``B`` apart are paired (``i``'s bit ``log2 B``) and become ``(a + b, a - b)``."""
    y = tl.permute(tl.reshape(x, [ROWS, N // (2 * B), 2, B]), [0, 1, 3, 2])
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2])
    return tl.reshape(y, [ROWS, N])


@triton.jit
def _fwht(x, ROWS: tl.constexpr, N: tl.constexpr):
    """``x [ROWS, N]`` times Sylvester's ``H`` of order ``N`` (a power of two <= 256), in
    ``x``'s dtype (float32 here): log2 N butterfly stages."""
    if N > 1:
        x = _butterfly(x, ROWS, N, 1)
    if N > 2:
        x = _butterfly(x, ROWS, N, 2)
    if N > 4:
        x = _butterfly(x, ROWS, N, 4)
    if N > 8:
        x = _butterfly(x, ROWS, N, 8)
    if N > 16:
        x = _butterfly(x, ROWS, N, 16)
    if N > 32:
        x = _butterfly(x, ROWS, N, 32)
    if N > 64:
        x = _butterfly(x, ROWS, N, 64)
    if N > 128:
        x = _butterfly(x, ROWS, N, 128)
    return x


@triton.jit
def _hadamard_halves(x1, x2, inv_sqrt_d, ROWS: tl.constexpr, HALF: tl.constexpr):
    """The halves ``[ROWS, HALF]`` of ``[x1, x2] H_D / sqrt(D)`` (see the module docstring),
    in float32, rounded to ``x1``'s dtype."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    h1 = _fwht(a + b, ROWS, HALF)
    h2 = _fwht(a - b, ROWS, HALF)
    return (h1 * inv_sqrt_d).to(x1.dtype), (h2 * inv_sqrt_d).to(x1.dtype)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, kv_scale_ptr,
    qw_ptr, kw_ptr, norm_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_q_heads, num_kv_heads, inv_sqrt_d,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, HADAMARD: tl.constexpr, HEAD_NORM: tl.constexpr,
    HEAD_NORM_UNIT_OFFSET: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    # Every load is issued before the first store: the compiler keeps a load after a store
    # it cannot prove apart (q, k and the caches may alias as far as it knows), so loads
    # placed after the q stores each added a global round trip to a program's latency,
    # which is the whole kernel at batch 1 (bench/README.md round 23).
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    r_mask = offs_r < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_r, mask=r_mask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_r, mask=r_mask, other=0.0)[None, :]
    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < num_q_heads) & r_mask[None, :]
    q_row = q_ptr + t * stride_qt + hq[:, None] * stride_qh + offs_r[None, :]
    q1 = tl.load(q_row, mask=q_mask, other=0.0)
    q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0)
    hk = tl.arange(0, BLOCK_HKV)
    h_mask = hk < num_kv_heads
    k_mask = h_mask[:, None] & r_mask[None, :]
    k_row = k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs_r[None, :]
    k1 = tl.load(k_row, mask=k_mask, other=0.0)
    k2 = tl.load(k_row + HALF, mask=k_mask, other=0.0)
    # The slot is loaded once per head (one value broadcast) so that ``write`` is a block
    # mask, not a scalar: masks must be blocks of int1 (triton 3.9's interpreter refuses a
    # scalar combined into a store mask).
    slot = tl.load(slot_ptr + t + 0 * hk).to(tl.int64)[:, None]
    write = slot >= 0
    offs_d = tl.arange(0, BLOCK_D)
    v_mask = h_mask[:, None] & write
    if BLOCK_D != HEAD_DIM:  # a head padded to a power of two: the pad is never touched
        v_mask = v_mask & (offs_d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs_d[None, :],
                mask=v_mask, other=0.0)
    tail = h_mask[:, None] & (offs_d[None, :] >= 2 * HALF) & write
    if BLOCK_D != HEAD_DIM:
        tail = tail & (offs_d < HEAD_DIM)[None, :]
    if 2 * HALF < HEAD_DIM:  # partial rotary: the tail of the head passes through unrotated
        k_tail = tl.load(k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs_d[None, :],
                         mask=tail, other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    if HEAD_NORM:
        qw1, qw2 = _norm_weight(qw_ptr, offs_r, r_mask, HALF)
        kw1, kw2 = _norm_weight(kw_ptr, offs_r, r_mask, HALF)

    # q: rotate all heads in place.
    if HEAD_NORM:
        q1, q2 = _head_norm(q1, q2, qw1, qw2, norm_eps, HEAD_DIM, HEAD_NORM_UNIT_OFFSET)
    o1, o2 = _rotate_half(q1, q2, cos, sin)
    o1 = o1.to(q1.dtype)
    o2 = o2.to(q1.dtype)
    if HADAMARD:
        o1, o2 = _hadamard_halves(o1, o2, inv_sqrt_d, BLOCK_HQ, BLOCK_HALF)
    tl.store(q_row, o1, mask=q_mask)
    tl.store(q_row + HALF, o2, mask=q_mask)

    # k: rotate in place, and write the rotated head to the cache slot (if any).
    if HEAD_NORM:
        k1, k2 = _head_norm(k1, k2, kw1, kw2, norm_eps, HEAD_DIM, HEAD_NORM_UNIT_OFFSET)
    r1, r2 = _rotate_half(k1, k2, cos, sin)
    r1 = r1.to(k1.dtype)
    r2 = r2.to(k1.dtype)
    if HADAMARD:
        r1, r2 = _hadamard_halves(r1, r2, inv_sqrt_d, BLOCK_HKV, BLOCK_HALF)
    tl.store(k_row, r1, mask=k_mask)
    tl.store(k_row + HALF, r2, mask=k_mask)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    kc_row = kc_ptr + blk * stride_kcb + off * stride_kco + hk[:, None] * stride_kch
    kc_dt = kc_ptr.dtype.element_ty
    tl.store(kc_row + offs_r[None, :], to_cache(r1, k_scale, kc_dt, KV_FP8),
             mask=k_mask & write)
    tl.store(kc_row + HALF + offs_r[None, :], to_cache(r2, k_scale, kc_dt, KV_FP8),
             mask=k_mask & write)
    if 2 * HALF < HEAD_DIM:
        tl.store(kc_row + offs_d[None, :], to_cache(k_tail, k_scale, kc_dt, KV_FP8),
                 mask=tail)
    vc_row = vc_ptr + blk * stride_vcb + off * stride_vco + hk[:, None] * stride_vch
    tl.store(vc_row + offs_d[None, :],
             to_cache(v, v_scale, vc_ptr.dtype.element_ty, KV_FP8), mask=v_mask)


def rope_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None, hadamard: bool = False,
    num_warps: int | None = None, head_norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_norm`` (when given; ``unit_offset``: Gemma's ``1 + w``) and RoPE on q and k
    (in place; then the Hadamard rotation with ``hadamard``), then the K/V cache write;
    returns the rotated ``(q, k)``. ``kv_scale`` (float32 ``[2]``, K then V) is required
    for an FP8 cache, else ignored. ``num_warps``: the launch's (default 8 up to 512
    tokens, 4 above: with or without the rotation the fastest or within 3 % of it at 1 to
    8,192 tokens, Llama-3-8B's layer on the H200, ``bench/time_rope_hadamard.py``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    fp8 = is_fp8(k_cache.dtype)
    assert not fp8 or (kv_scale is not None and kv_scale.dtype == torch.float32
                       and kv_scale.numel() == 2), "an FP8 cache needs float32 kv_scale [2]"
    assert not hadamard or 2 <= rotary_dim == head_dim <= 512, \
        "the Hadamard rotation needs RoPE over the whole head, of 2 to 512"
    assert head_norm is None or (
        rotary_dim == head_dim and head_norm.q_weight.shape == head_norm.k_weight.shape
        == (head_dim,) and head_norm.q_weight.is_contiguous()
        and head_norm.k_weight.is_contiguous()), \
        "the fused head norm needs RoPE over the whole head and contiguous [head_dim] weights"
    if num_warps is None:
        num_warps = 8 if num_tokens <= 512 else 4
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        kv_scale if fp8 else cos_sin_cache,  # a float32 pointer that is never read
        *(head_norm[:3] if head_norm is not None else (q, q, 0.0)),  # never read without it
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads, head_dim ** -0.5,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), PAGE_SIZE=k_cache.shape[1],
        KV_FP8=fp8, HADAMARD=hadamard, HEAD_NORM=head_norm is not None,
        HEAD_NORM_UNIT_OFFSET=head_norm is not None and head_norm.unit_offset,
        enable_fp_fusion=FP_FUSION, num_warps=num_warps,
    )
    return q, k
