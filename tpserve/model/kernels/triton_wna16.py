"""The WNA16 GEMM as a Triton kernel (``--quantization gptq`` / ``awq``): integer weights
(4 or 8 bits, packed along K) with float group scales and zero points, activations in
fp16 / bf16 / fp32. See ``model/quant/wna16.py`` for the served layout and the torch
reference ``linear``.

Numerics: each program dequantizes its weight tile in registers exactly as the reference
does, ``W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]`` in float32,
rounded once to the activation dtype, then multiplies it with ``tl.dot`` (operand dtype
and precision from ``triton_support.dot_config``) into a float32 accumulator; the bias is
added to the K-complete float32 sum (after the split reduction when split) and the result
rounded once to the activation dtype. So the result is the reference's up to float32
summation order and the output's rounding. ``g_idx`` is gathered per input column: any
group order (GPTQ act-order) is served by the same program. Off CUDA, Triton 3.9's
interpreter truncates float32 -> bf16 casts: there the weight is first rounded to nearest
even by bit arithmetic (``_round_bf16``), so it is still the reference's bit for bit (the
output's cast there truncates: within one bf16 ulp).

Launch: shapes alone choose it (``wna16_blocks``): decode (M <= 16) 16-row tiles with K
split over programs (``fill_split``: two per SM, chunks of at least two K steps) so a
few output tiles still fill the GPU; float32 partials in a ``torch.empty`` of a static size, summed in order by
``triton_fp8.reduce_splits``. No host synchronisation: capturable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_fp8 import (
    WoConfig,
    _sm_count,
    _wo_epilogue,
    reduce_splits,
    split_k,
)
from tpserve.model.kernels.triton_support import dot_config
from tpserve.model.quant.wna16 import pack_factor


def fill_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """The K split for ``tiles`` output tiles: enough programs for two per SM, at most one
    per two ``block_k`` steps of K (``triton_fp8.auto_split`` allows one per four, which
    leaves a tp-8 shard at decode, 8 tiles of 512 x 4096, on 64 of 132 SMs; here 128)."""
    return max(1, min(triton.cdiv(2 * sms, tiles), k // (2 * block_k)))


def wna16_blocks(m: int, n: int, k: int, sms: int) -> WoConfig:
    """The launch (a ``WoConfig`` of kind "wna16", its ``split`` resolved by
    ``fill_split``) for a static ``(M, N, K)`` on ``sms`` SMs. Tiles by M: up to 16 rows
    (decode) 16 x 64 output tiles over 128-column K steps; up to 64 rows 32- or 64-row
    tiles over 64-column steps; larger M 64 x 128 tiles, 8 warps. At decode on 132 SMs the
    llama3-8b layers split qkv's 96 tiles three ways, o's and down's 64 five ways, and leave
    gate_up's 448 whole. Not yet tuned by a sweep: the shapes and stages are first choices
    that keep the dequantized tile (``BLOCK_K x BLOCK_N`` float32 in registers) small."""
    if m <= 16:
        cfg = WoConfig("wna16", 16, 64, 128, 0, 4, 3)
    elif m <= 32:
        cfg = WoConfig("wna16", 32, 64, 64, 0, 4, 3)
    elif m <= 64:
        cfg = WoConfig("wna16", 64, 64, 64, 0, 4, 3)
    else:
        cfg = WoConfig("wna16", 64, 128, 64, 0, 8, 3)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return cfg._replace(split=fill_split(tiles, k, cfg.block_k, sms))


@triton.jit
def _round_bf16(w):
    """float32 ``w`` rounded to the nearest bf16 (ties to even), as float32 (finite ``w``):
    the interpreter's float32 -> bf16 cast truncates (triton 3.9), the GPU's rounds."""
    b = w.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _wna16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, p_ptr, M, N, K, K_CHUNK,
                  stride_x, stride_q, stride_s, stride_y,
                  BITS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                  PARTIAL: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  ROUND_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Program ``(m, n, s)``: output tile ``m, n`` over K columns ``s*K_CHUNK ..
    +K_CHUNK`` (a multiple of ``BLOCK_K``, itself a multiple of the pack factor). Each
    step loads the packed int32 of every column's row ``k // PACK`` (``PACK`` columns
    share a row: repeated loads, served by the cache), shifts out its code, gathers the
    scale and zero rows ``g_idx[k]``, and forms ``(q - z) * s`` in float32 rounded to the
    activation dtype (``ROUND_BF16``: by ``_round_bf16`` first, off CUDA), then
    ``tl.dot`` in ``DOT_DTYPE``. Columns past K (the last chunk or a K tail) load code,
    zero, scale and activation 0: they add nothing. Offsets inside ``qweight``, ``scales``
    and ``zeros`` are int32 (the wrapper checks their sizes)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    act_dtype = x_ptr.dtype.element_ty
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = pid_k * K_CHUNK
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x_ok = m_ok[:, None]
            w_ok = n_ok[None, :]
            g = tl.load(g_ptr + kk)
        else:
            k_ok = kk < K
            x_ok = m_ok[:, None] & k_ok[None, :]
            w_ok = k_ok[:, None] & n_ok[None, :]
            g = tl.load(g_ptr + kk, mask=k_ok, other=0)
        packed = tl.load(q_ptr + (kk // PACK)[:, None] * stride_q + rn[None, :], mask=w_ok,
                         other=0)
        q = (packed >> ((kk % PACK) * BITS)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
        sz = g[:, None] * stride_s + rn[None, :]
        s = tl.load(s_ptr + sz, mask=w_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=w_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
        if ROUND_BF16:
            w = _round_bf16(w)  # then the cast below is exact
        w = w.to(act_dtype)
        x = tl.load(x_rows + kk[None, :], mask=x_ok, other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, s_ptr, b_ptr, y_ptr, p_ptr, stride_y,
                 HAS_BIAS, PARTIAL, False)


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, config: WoConfig | str | None = None
                 ) -> torch.Tensor:
    """``x [M, K]`` (fp16 / bf16 / fp32, contiguous rows) times the WNA16 weight in the
    served layout (``qweight`` int32 ``[K // pack, N]``, ``scales`` and ``zeros`` ``[G, N]``
    in x's dtype, ``g_idx`` int32 ``[K]``, all with contiguous rows), plus ``bias [N]``:
    ``[M, N]`` in x's dtype, ``quant.wna16.linear`` up to float32 summation order.
    ``config`` (a ``WoConfig`` of kind "wna16" or its string; split 0: ``fill_split``)
    overrides ``wna16_blocks`` (benchmarks, tests). Shapes alone choose the launch and the
    split partials are a ``torch.empty`` of a static size: capturable in CUDA graphs."""
    pack = pack_factor(bits)
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous rows"
    assert scales.dtype == zeros.dtype == x.dtype, (x.dtype, scales.dtype, zeros.dtype)
    assert qweight.dtype == torch.int32 and g_idx.dtype == torch.int32
    assert qweight.stride(-1) == 1 and scales.stride(-1) == 1 and g_idx.stride(-1) == 1
    assert zeros.shape == scales.shape and zeros.stride() == scales.stride()
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * pack == k and g_idx.shape == (k,) and scales.shape[1] == n, (
        f"x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
        f"{tuple(scales.shape)}, g_idx {tuple(g_idx.shape)} at {bits} bits")
    assert qweight.shape[0] * qweight.stride(0) < 2**31 and scales.numel() < 2**31
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if config is None:
        cfg = wna16_blocks(m, n, k, _sm_count(x.device))
    else:
        cfg = WoConfig.parse(config) if isinstance(config, str) else config
    if cfg.kind != "wna16":
        raise ValueError(f"not a wna16 launch: {cfg}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    assert bk % pack == 0, f"K steps of {bk} columns split packed words of {pack}"
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = cfg.split or fill_split(m_tiles * n_tiles, k, bk, _sm_count(x.device))
    split, k_chunk, even_k, part = split_k(split, m, n, k, bk, y)
    dot_dtype, precision = dot_config(x.dtype, x.device)
    _wna16_kernel[(m_tiles, n_tiles, split)](
        x, qweight, scales, zeros, g_idx, bias if bias is not None else scales, y, part,
        m, n, k, k_chunk, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, EVEN_K=even_k, PARTIAL=split > 1,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        ROUND_BF16=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_splits(part, None, bias, y, split)
    return y
