"""Paged varlen causal attention for prefill (and chunked-prefill) sequences.

Layouts:
- ``q``/``out [T, Hq, D]``: the flat batch of new tokens (head dim contiguous);
- ``k_cache``/``v_cache [num_blocks, PAGE_SIZE, Hkv, D]`` already holding every sequence's
  context *including* its new tokens; ``block_tables [B, max_blocks]`` int32;
- ``query_start_loc [B + 1]`` and ``seq_lens [B]`` int32 as in AttentionMetadata.

Work list: ``tiles`` (int32, see ``attention.triton_backend.prefill_tiles``) names one query tile
per entry, ``(i << 16) | m``; entries < 0 are padding and do nothing, so a CUDA graph can be
captured with a grid sized for the largest step and replayed for any smaller one. Sequence
``i`` has ``n = qsl[i+1] - qsl[i]`` new tokens at positions ``ctx .. ctx + n - 1`` with
``ctx = seq_lens[i] - n`` cached tokens before them; query ``j`` attends to keys
``0 .. ctx + j``. Program ``(tile, head)`` computes query tokens ``m * BLOCK_M ..`` of
sequence ``i`` for one query head with a flash-attention online softmax (float32, log2
domain). Key tiles entirely left of the tile's first query are processed without masks;
only the last ``ceil(BLOCK_M / BLOCK_N) + 1`` tiles at most are causally masked. With a
sliding ``WINDOW`` query ``j`` sees keys ``ctx + j - WINDOW + 1 .. ctx + j`` only: the key
tiles start at the tile's first row's first key and every tile is masked (a row may see
no key of the first ones). K/V rows are
gathered through the block table per token, so ``BLOCK_N`` is independent of ``PAGE_SIZE``.
With a logit ``SOFTCAP`` (Gemma 2's; 0: off, the code as without it) every tile's scores are
capped before the mask, in the log2 domain as the decode kernel does
(``triton_softcap``).

FP8 cache (``KV_FP8``): K/V tiles are loaded as e4m3 and widened exactly to q's dtype, or
(``FP16_DOT``, the default under a 16-bit q) to fp16 with q pre-scaled into fp16 (the
hardware widens e4m3 to fp16 in one instruction; to bf16 it takes more); the K scale
``kv_scale[0]`` is folded into the score scale and the V scale ``kv_scale[1]`` into the
output, both read on the device (``dequantize`` then attend, up to float32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_softcap import LOG2E, cap_logits, softcap_constexpr
from tpserve.model.kernels.triton_support import FP_FUSION, check_head_dim, dot_config, tl_dtype
from tpserve.model.kv_cache_dtype import is_fp8

# Measured on an H200 (bf16, D=128): 64x64 tiles with 4 warps and 2 stages were the best or
# near-best single choice across long, chunked and short-batch prefills.
BLOCK_M = 64  # query tokens per program (the tile table is built for it)
BLOCK_N = 64  # keys per inner-loop tile
# An FP8 cache with fp16 operands (f0fd095, bench/tune_prefill.py --fp8): 128-key tiles
# were the best of seven launches in all three cases (54.6 / 31.1 / 311.0 us against
# 57.4 / 33.6 / 312.0 with 64 keys; a bf16 cache: 52.3 / 26.6 / 259.3).
FP8_BLOCK_N = 128
# Gemma's heads of 256 at 4 warps spill registers (sm_90a, Triton 3.9, compiled offline:
# 255 registers and 29 spill stores bf16, 51 over FP8); at 8 warps neither spills (232 and
# 240 registers, with the softcap 228 and 250). Chosen by that count, not yet timed.
WIDE_HEAD_WARPS = 8
# float32 on a GPU (ieee products, bench/tune_prefill.py --dtype float32, round 37, H100):
# 64 x 64 tiles spill thousands of bytes a thread and took 17.5 ms on 4 chunks of 113 tokens
# over 1,700 (0.7 TFLOP/s); 16-row query tiles over 64 keys at 4 warps, the best or within
# 3.4 % of the best of seven ieee launches in all five cases, took 1.42 ms there, 0.64 ms for
# 448 tokens over 576, 6.6 ms for 8 x 1,024, and 75 us for a drafted step's 16 positions
# over 600 (2.58 ms before): 12-46x.
FP32_BLOCK_M = 16
FP32_BLOCK_N = 64


def _float32_on_cuda(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether queries of ``dtype`` on ``device`` take the float32 launch (round 37)."""
    return dtype == torch.float32 and device.type == "cuda"


def query_tile_rows(dtype: torch.dtype, device: torch.device) -> int:
    """The query rows of a prefill tile for queries of ``dtype`` on ``device``: the tile
    table (``attention.triton_backend.prefill_tiles``) must be built for the same height
    the launch is given as ``block_m``. 16 for float32 on CUDA, else ``BLOCK_M``."""
    return FP32_BLOCK_M if _float32_on_cuda(dtype, device) else BLOCK_M


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, tok0, offs_n, pos_q, seq_len, bt_row, k_head, v_head,
    stride_kb, stride_ko, stride_vb, stride_vo, scale_log2, offs_d,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, WIDEN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr = 0,
    HEAD_DIM: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """One online-softmax step over keys ``tok0 .. tok0 + BLOCK_N - 1`` (K, V and the
    probabilities rounded to ``WIDEN_DTYPE`` before the matmuls); with a ``WINDOW`` (masked
    tiles only) a row sees keys ``pos - WINDOW + 1 .. pos`` and may see none of the tile.
    ``HEAD_DIM`` (non-zero: a head padded to ``offs_d``'s power of two): its pad reads 0.
    ``SOFTCAP`` (non-zero: the cap in log2 units): the scores capped before the mask."""
    toks = tok0 + offs_n
    if MASKED:
        valid = toks < seq_len
        blk = tl.load(bt_row + toks // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + toks // PAGE_SIZE).to(tl.int64)
    off = toks % PAGE_SIZE
    k_ptrs = k_head + blk[:, None] * stride_kb + off[:, None] * stride_ko + offs_d[None, :]
    v_ptrs = v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo + offs_d[None, :]
    if HEAD_DIM > 0:
        d_ok = (offs_d < HEAD_DIM)[None, :]
        if MASKED:
            kv_mask = valid[:, None] & d_ok
        else:
            kv_mask = d_ok
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    elif MASKED:
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k.to(WIDEN_DTYPE).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    s = s * scale_log2
    if SOFTCAP > 0:
        s = cap_logits(s, SOFTCAP)
    if MASKED:
        keep = valid[None, :] & (toks[None, :] <= pos_q[:, None])
        if WINDOW > 0:
            keep = keep & (toks[None, :] > pos_q[:, None] - WINDOW)
        s = tl.where(keep, s, float("-inf"))
    # Without a window finite: the first tile reached has a visible key for every row (see
    # the caller). With one, a row that has seen no key yet keeps -inf and adds nothing.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if WINDOW > 0:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if HEAD_DIM > 0:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif MASKED:
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(WIDEN_DTYPE).to(DOT_DTYPE),
                                        v.to(WIDEN_DTYPE).to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    tiles_ptr, scale_log2, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WIDEN_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, FP16_DOT: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.load(tiles_ptr + tl.program_id(0))
    head = tl.program_id(1)
    seq = tl.maximum(tile, 0) >> 16
    m_block = tile & 0xFFFF
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if (tile >= 0) & (m_block * BLOCK_M < q_len):
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)
        if BLOCK_D != HEAD_DIM:  # a head padded to a power of two: the pad reads as 0
            io_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
            PAD_D: tl.constexpr = HEAD_DIM
        else:
            io_mask = m_mask[:, None]
            PAD_D: tl.constexpr = 0
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)
        if KV_FP8:
            scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
        if FP16_DOT:  # scores come out already scaled: e4m3 widens to fp16 in one step
            q = (q.to(tl.float32) * scale_log2).to(tl.float16)
            scale_log2 = 1.0
        q = q.to(DOT_DTYPE)
        pos_q = ctx + offs_m  # padded rows (>= q_len) see keys < seq_len; never stored

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head = head // GROUP
        k_head = k_cache_ptr + kv_head * stride_kh
        v_head = v_cache_ptr + kv_head * stride_vh
        first_pos = ctx + m_block * BLOCK_M
        # Keys < first_pos are visible to every row: whole tiles of them need no mask. The
        # first masked tile starts at or before first_pos, so each row sees a key in it.
        unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
        if WINDOW > 0:  # every tile masked, from the first row's first key on
            lo = tl.maximum(first_pos - WINDOW + 1, 0)
            for tok0 in range((lo // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, tok0, offs_n, pos_q, seq_len, bt_row, k_head, v_head,
                    stride_kb, stride_ko, stride_vb, stride_vo, scale_log2, offs_d,
                    PAGE_SIZE, True, WIDEN_DTYPE, DOT_DTYPE, DOT_PRECISION, WINDOW, PAD_D,
                    SOFTCAP)
        else:
            for tok0 in range(0, unmasked_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, tok0, offs_n, pos_q, seq_len, bt_row, k_head, v_head,
                    stride_kb, stride_ko, stride_vb, stride_vo, scale_log2, offs_d,
                    PAGE_SIZE, False, WIDEN_DTYPE, DOT_DTYPE, DOT_PRECISION, 0, PAD_D,
                    SOFTCAP)
            for tok0 in range(unmasked_end, kv_end, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, acc, m_i, l_i, tok0, offs_n, pos_q, seq_len, bt_row, k_head, v_head,
                    stride_kb, stride_ko, stride_vb, stride_vo, scale_log2, offs_d,
                    PAGE_SIZE, True, WIDEN_DTYPE, DOT_DTYPE, DOT_PRECISION, 0, PAD_D,
                    SOFTCAP)
        if WINDOW > 0:  # a padding row (never stored) may have seen no key
            l_i = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_i[:, None]
        if KV_FP8:
            o = o * tl.load(kv_scale_ptr + 1)
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tiles: torch.Tensor, scale: float,
    out: torch.Tensor, block_m: int = BLOCK_M, block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2, kv_scale: torch.Tensor | None = None, fp16_dot: bool | None = None,
    window: int | None = None, softcap: float | None = None, precision: str | None = None,
) -> torch.Tensor:
    """Writes attention of the query tiles listed in ``tiles`` into ``out``.

    ``tiles`` must have been built for ``block_m`` (``prefill_tiles(..., tile_m=block_m)``);
    its length fixes the launch grid and nothing here reads the device, so the launch is
    CUDA-graph capturable. The tile and launch keywords are tuning knobs (results do not
    depend on them beyond rounding; ``block_m`` is the tile table's height, which the caller
    chooses, ``query_tile_rows`` where it serves; ``block_n`` defaults to ``BLOCK_N``,
    ``FP8_BLOCK_N`` over an FP8 cache, ``FP32_BLOCK_N`` for float32 queries on CUDA;
    ``num_warps`` to 4, or ``WIDE_HEAD_WARPS`` for heads wider than 128; ``precision`` to
    ``dot_config``'s, ieee for float32). ``kv_scale`` (float32 ``[2]``, K then V) is required for an FP8
    cache, else ignored. ``fp16_dot`` (FP8 cache under a 16-bit q; default on
    there): the matmuls take fp16 operands (q pre-scaled, e4m3 widened to fp16 exactly).
    ``window``: a sliding window, each query over its last ``window`` positions.
    ``softcap``: Gemma 2's logit cap c (None: off; else > 0), each logit ``s`` becoming
    ``c tanh(s / c)``.
    """
    _, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_head_dim(head_dim)
    cap = softcap_constexpr(softcap)  # refused even when there are no tiles to launch
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} q heads vs {num_kv_heads} kv heads"
    assert q.stride(-1) == out.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert tiles.dtype == torch.int32, tiles.dtype
    fp8 = is_fp8(k_cache.dtype)
    assert not fp8 or (kv_scale is not None and kv_scale.dtype == torch.float32
                       and kv_scale.numel() == 2), "an FP8 cache needs float32 kv_scale [2]"
    if tiles.numel() == 0:
        return out
    if block_n is None:
        block_n = (FP32_BLOCK_N if _float32_on_cuda(q.dtype, q.device)
                   else FP8_BLOCK_N if fp8 else BLOCK_N)
    if num_warps is None:
        num_warps = WIDE_HEAD_WARPS if head_dim > 128 else 4
    dot_dtype, default_precision = dot_config(q.dtype, q.device)
    precision = precision or default_precision
    fp16_dot = fp8 and q.dtype in (torch.bfloat16, torch.float16) and fp16_dot is not False
    if fp16_dot and dot_dtype != tl.float32:
        dot_dtype = tl.float16
    _prefill_kernel[(tiles.numel(), num_q_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tiles,
        scale * LOG2E, kv_scale if fp8 else out,  # never read unless FP8
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, KV_FP8=fp8, FP16_DOT=fp16_dot,
        WIDEN_DTYPE=tl.float16 if fp16_dot else tl_dtype(q.dtype), WINDOW=window or 0,
        SOFTCAP=cap,
        enable_fp_fusion=FP_FUSION, num_warps=num_warps, num_stages=num_stages,
    )
    return out
