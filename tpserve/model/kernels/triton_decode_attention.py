"""Paged decode attention (one query token per sequence) with GQA packing and split-K.

Layouts:
- ``q [B, Hq, D]`` (one new token per sequence; head dim contiguous), ``out`` likewise;
- ``k_cache``/``v_cache [num_blocks, PAGE_SIZE, Hkv, D]``; ``block_tables [B, max_blocks]``
  int32; ``seq_lens [B]`` int32 (context length including the new token, already cached).

With a sliding ``WINDOW`` only a sequence's last ``WINDOW`` keys count: the tiles dealt out
start at the tile holding the first of them, which is masked below it.

With a logit ``SOFTCAP`` (Gemma 2's ``attn_logit_softcapping`` c, passed as ``c log2(e)``;
0: off, and the code is as without it) each score is capped as it leaves the matmul, before
the mask: in the log2 domain ``c log2(e) tanh(s / (c log2(e)))`` is ``log2(e)`` times the
capped true logit ``c tanh(qk scale / c)`` (``triton_softcap``: float32, ~2e-7 relative).

Work split: program ``(b, h, s)`` owns sequence ``b``, KV head ``h`` and split ``s``. It holds
all ``GROUP = Hq / Hkv`` query heads of that KV head as the rows of one ``[BLOCK_G, D]`` tile
(``BLOCK_G >= 16`` so the matmuls map onto tensor cores), so every K/V row is loaded once per
KV head. With ``FMA`` (for a float32 cache: ieee products run on the CUDA cores, where 16
padded rows are 16 / GROUP times the work) the tile has ``BLOCK_G = next_pow2(GROUP)`` rows
(at least 2) and both products are float32 broadcast multiplies summed over the reduced axis
(``tl.sum``), not ``tl.dot``. The ``ceil(L / BLOCK_N)`` key tiles of a sequence of length
``L`` are dealt out in contiguous runs of ``ceil(tiles / NUM_SPLITS)`` tiles to the splits; a
split past the end does nothing and reports an empty softmax (max ``-inf``, sum 0). Keys are
gathered through the block table per token, so ``BLOCK_N`` is independent of ``PAGE_SIZE``.

With one split the kernel normalises and writes ``out`` directly. Otherwise it writes
unnormalised partials ``part_out [B, Hq, NUM_SPLITS, D]`` and ``part_max``/``part_sum
[B, Hq, NUM_SPLITS]`` (float32, maxima in the log2 domain), and a second kernel combines them.

FP8 cache (``KV_FP8``): K/V rows are loaded as e4m3 and widened exactly to q's dtype, or
(``FP16_DOT``, the default under a 16-bit q) to fp16 with q pre-multiplied by the score
scale into fp16 (e4m3 widens to fp16 in one instruction; |q| * scale stays far inside
fp16's range: the score scale is about 0.13 times the K scale); the K scale
``kv_scale[0]`` is folded into the score scale, both read on the device. The V scale
``kv_scale[1]`` goes into the output (before the split partials are written) or, with
``SCALE_V`` (fp16 operands only), into the widened V tile itself: ``fp16(v) * fp16(scale)``
(rounded to fp16; |v| <= 448 * scale, which a bf16 cache's values never approach). The
multiply changes what the compiler stages in shared memory: without it, e4m3 V goes there
and is read into the matmul's transposed operand layout one byte per load (Hopper has no
8-bit transposing ``ldmatrix``); with it, the widened fp16 tile goes there and is read by
a transposing ``ldmatrix``, and the kernel needs ~45 fewer registers per thread. This is
``dequantize`` then attend, up to float32 rounding (and fp16's for q, p and a scaled V).

CUDA graphs: the launch grid depends only on host ints (``B``, ``Hkv``, the split count) and
sequence lengths are read on the device, so one capture is valid for any lengths; a sequence
of length 0 (batch padding) writes nothing to ``out`` (so its rows may belong to work another
kernel does at the same time: a mixed step's prefill tokens, see ``paged_attention``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.decode_launch import default_launch
from tpserve.model.kernels.triton_softcap import LOG2E, cap_logits, softcap_constexpr
from tpserve.model.kernels.triton_support import FP_FUSION, check_head_dim, dot_config
from tpserve.model.kv_cache_dtype import is_fp8

LAZY_TAU = 8.0  # lazy_rescale: scores may pass the running maximum by this (log2) before it moves


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, kv_scale_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    FP16_DOT: tl.constexpr, LATE_WIDEN: tl.constexpr, SWAP_QK: tl.constexpr,
    HEADS_FIRST: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SCALE_V: tl.constexpr,
    LAZY: tl.constexpr, TAU: tl.constexpr, BT_AHEAD: tl.constexpr, FMA: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW > 0:  # keys first .. seq_len - 1, in tiles from first's tile on
        first = tl.maximum(seq_len - WINDOW, 0)
        base = (first // BLOCK_N) * BLOCK_N
    else:
        first = 0
        base = 0
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - base, BLOCK_N), NUM_SPLITS)
    start = base + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    if BLOCK_D != HEAD_DIM:  # a head dim padded to a power of two: the pad reads as 0
        d_ok = (offs_d < HEAD_DIM)[None, :]
        q_mask = g_mask[:, None] & d_ok
    else:
        q_mask = g_mask[:, None]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    io_dtype = q.dtype
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    if FP16_DOT:  # scores come out already scaled: e4m3 widens to fp16 in one instruction
        q = (q.to(tl.float32) * scale_log2).to(tl.float16)
        scale_log2 = 1.0
        io_dtype = tl.float16
        if SCALE_V:
            v_scale = tl.load(kv_scale_ptr + 1).to(tl.float16)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    if BT_AHEAD:  # the first tile's block-table entries, before the loop
        blk_next = tl.load(bt_row + (start + offs_n) // PAGE_SIZE,
                           mask=start + offs_n < end, other=0).to(tl.int64)
    else:
        blk_next = offs_n.to(tl.int64)  # unused
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        if WINDOW > 0:
            valid = (toks < end) & (toks >= first)
        else:
            valid = toks < end
        off = toks % PAGE_SIZE
        if BT_AHEAD:  # this tile's entries came a tile ahead; the next tile's load now
            blk = blk_next
            ahead = toks + BLOCK_N
            blk_next = tl.load(bt_row + ahead // PAGE_SIZE, mask=ahead < end,
                               other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + toks // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        if BLOCK_D != HEAD_DIM:
            kv_mask = valid[:, None] & d_ok
        else:
            kv_mask = valid[:, None]
        k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ko
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if FMA:  # [G, N, D] float32 products summed over D on the CUDA cores
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        elif SWAP_QK:
            s = tl.trans(tl.dot(k.to(io_dtype).to(DOT_DTYPE), tl.trans(q),
                                input_precision=DOT_PRECISION))
        else:
            if LATE_WIDEN:
                kt = tl.trans(k).to(io_dtype).to(DOT_DTYPE)
            else:
                kt = tl.trans(k.to(io_dtype).to(DOT_DTYPE))
            s = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if SOFTCAP > 0:  # capped before the mask, in the log2 domain (module docstring)
            s = tl.where(valid[None, :], cap_logits(s * scale_log2, SOFTCAP), float("-inf"))
        else:
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        # finite: every tile has a valid key (with a window, the first tile holds ``first``)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if LAZY:  # move the maximum (and rescale) only when some row passes it by > TAU
            if tl.max(m_new - m_i, axis=0) > TAU:  # +inf on the first tile
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.exp2(s - m_i[:, None])  # <= 2**TAU
            l_i = l_i + tl.sum(p, axis=1)
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if SCALE_V:
            v = (v.to(tl.float16) * v_scale).to(DOT_DTYPE)
        else:
            v = v.to(io_dtype).to(DOT_DTYPE)
        if FMA:  # [G, N, D] summed over N
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            pv = tl.dot(p.to(io_dtype).to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        if LAZY:
            acc = acc + pv
        else:
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if KV_FP8 and not SCALE_V:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if NUM_SPLITS == 1:  # a slot of length 0 (CUDA-graph padding) writes nothing
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_mask = (offs_g < tl.where(seq_len > 0, GROUP, 0))[:, None]
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & d_ok
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row = (seq * (GROUP * NUM_KV_HEADS) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        p_mask = g_mask[:, None]
        if BLOCK_D != HEAD_DIM:
            p_mask = p_mask & d_ok
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=p_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, seq_lens_ptr,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = (seq * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_max_ptr + rows)
    l_s = tl.load(part_sum_ptr + rows)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D != HEAD_DIM:
        acc = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        acc = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :])
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights 0
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_s, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < tl.where(seq_len > 0, HEAD_DIM, 0))


def split_partials(batch: int, num_q_heads: int, num_splits: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scratch of a split launch (float32): each split's unnormalised output
    ``[B, Hq, splits, D]``, its running maximum and its sum ``[B, Hq, splits]``."""
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                           device=device)
    part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32,
                           device=device)
    return part_out, part_max, torch.empty_like(part_max)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None, fp16_dot: bool | None = None,
    late_widen: bool | None = None, swap_qk: bool | None = None,
    heads_first: bool | None = None, scale_v: bool | None = None,
    lazy_rescale: bool | None = None, maxnreg: int | None = None,
    bt_ahead: bool | None = None, fma: bool | None = None,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Writes decode attention of ``q [B, Hq, D]`` into ``out [B, Hq, D]`` and returns it.

    ``num_splits`` must be a power of two; no host synchronisation happens here. The tile
    and launch keywords are tuning knobs (results do not depend on them beyond rounding);
    left ``None`` they take the measured launch of the cache dtype and grid
    (``decode_launch.default_launch``; its split count is ``default_num_splits``). ``kv_scale`` (float32
    ``[2]``, K then V) is required for an FP8 cache, else ignored. ``fp16_dot`` (FP8 cache,
    16-bit q only): the matmuls take fp16 operands (q pre-scaled, e4m3 widened to fp16
    exactly) instead of q's dtype; ``scale_v`` (with it): the V scale goes into the widened
    V tile instead of the output; ``lazy_rescale``, ``maxnreg``, ``bt_ahead``, ``fma``: see
    ``decode_launch.DecodeLaunch``. ``partials``: the split scratch (``split_partials``)
    when the caller allocated it, e.g. before running this on another stream; None
    allocates it here. A sequence of length 0 leaves its rows
    of ``out`` as they were. ``window``: a sliding window, each query over its sequence's
    last ``window`` keys (the splits share those keys' tiles out). ``softcap``: Gemma 2's
    logit cap c (None: off; else > 0), each logit ``s`` becoming ``c tanh(s / c)``.
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_head_dim(head_dim)
    cap = softcap_constexpr(softcap)  # refused before anything is allocated or launched
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} q heads vs {num_kv_heads} kv heads"
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, num_splits
    assert q.stride(-1) == out.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    fp8 = is_fp8(k_cache.dtype)
    assert not fp8 or (kv_scale is not None and kv_scale.dtype == torch.float32
                       and kv_scale.numel() == 2), "an FP8 cache needs float32 kv_scale [2]"
    if batch == 0:
        return out
    given = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
             "fp16_dot": fp16_dot, "late_widen": late_widen, "swap_qk": swap_qk,
             "heads_first": heads_first, "scale_v": scale_v, "lazy_rescale": lazy_rescale,
             "maxnreg": maxnreg, "bt_ahead": bt_ahead, "fma": fma}
    launch = default_launch(k_cache.dtype, batch, num_kv_heads)._replace(
        **{k: v for k, v in given.items() if v is not None})
    (block_n, num_warps, num_stages, fp16_dot, late_widen, swap_qk, heads_first, scale_v, _,
     lazy, maxnreg, bt_ahead, fma, _) = launch
    group = num_q_heads // num_kv_heads
    assert not (fma and fp8), "the FMA form reads a 16- or 32-bit cache"
    block_g = max(2 if fma else 16, triton.next_power_of_2(group))
    dot_dtype, precision = dot_config(q.dtype, q.device)
    fp16_dot = fp16_dot and fp8 and q.dtype in (torch.bfloat16, torch.float16)
    if fp16_dot and dot_dtype != tl.float32:
        dot_dtype = tl.float16
    if num_splits == 1:
        part_out = part_max = part_sum = out  # unused by the single-split variant
    else:
        if partials is None:
            partials = split_partials(batch, num_q_heads, num_splits, head_dim, q.device)
        part_out, part_max, part_sum = partials
        assert part_out.shape == (batch, num_q_heads, num_splits, head_dim), part_out.shape
    grid = (num_kv_heads, batch) if heads_first else (batch, num_kv_heads)
    _decode_split_kernel[(*grid, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_max, part_sum,
        scale * LOG2E, kv_scale if fp8 else part_max,  # a float32 pointer, unread if not FP8
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, KV_FP8=fp8, FP16_DOT=fp16_dot,
        LATE_WIDEN=late_widen and fp8, SWAP_QK=swap_qk, HEADS_FIRST=heads_first,
        NUM_KV_HEADS=num_kv_heads, SCALE_V=scale_v and fp16_dot, LAZY=lazy, TAU=LAZY_TAU,
        BT_AHEAD=bt_ahead, FMA=fma, WINDOW=window or 0,
        SOFTCAP=cap,
        enable_fp_fusion=FP_FUSION, num_warps=num_warps, num_stages=num_stages,
        maxnreg=maxnreg,  # None: no cap
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_out, part_max, part_sum, out, seq_lens, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits, enable_fp_fusion=FP_FUSION, num_warps=4,
        )
    return out
