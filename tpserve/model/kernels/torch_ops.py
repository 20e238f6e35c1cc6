"""Reference ops in plain torch: the CPU path and the oracle every GPU kernel is tested against.

KV cache layout (one layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; flat slot ``s`` is block
``s // block_size``, offset ``s % block_size``.
RoPE cache layout: ``cos_sin_cache`` is ``[max_positions, rotary_dim]`` float32, the first
half cosines and the second half sines (rotate-half / "neox" pairing, as Hugging Face Llama).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kv_cache_dtype import FP8_KV_DTYPE, FP8_MAX, is_fp8
from tpserve.model.kv_hadamard import hadamard_rotate
from tpserve.model.quant.fp8 import quantize_per_row, quantize_static
from tpserve.model.quant.fp8_block import quantize_per_group


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as Hugging Face's Llama
    does). With ``unit_offset`` (Gemma's norms: the checkpoint stores ``w``, the scale is
    ``1 + w``) the scale multiplies in float32 and the product is cast to ``x``'s dtype,
    as Hugging Face's Gemma does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    sum_out: torch.Tensor | None = None, unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is stored in ``sum_out``
    when given (a contiguous tensor of the sum's shape and dtype, e.g. ``residual`` itself:
    the layers' residual stream is updated in place, with no new allocation)."""
    summed = torch.add(x, residual, out=check_sum_out(sum_out, x, residual))
    return rms_norm(summed, weight, eps, unit_offset), summed


def holds_sum(t: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``t`` can take ``x + residual`` in place: its shape and dtype, contiguous."""
    return (t.shape == x.shape and t.is_contiguous()
            and t.dtype == torch.promote_types(x.dtype, residual.dtype))


def check_sum_out(sum_out: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor
                  ) -> torch.Tensor | None:
    """``sum_out`` after checking it can hold ``x + residual`` (``holds_sum``)."""
    if sum_out is not None and not holds_sum(sum_out, x, residual):
        dtype = torch.promote_types(x.dtype, residual.dtype)
        raise ValueError(f"sum_out {tuple(sum_out.shape)} {sum_out.dtype} cannot hold the "
                         f"sum {tuple(x.shape)} {dtype} (contiguous)")
    return sum_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (Gemma's ``gelu_pytorch_tanh``:
    GeLU's tanh approximation)."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture of experts' grouped product: ``a`` ``[R, K]``, its rows grouped by expert
    (group e's end at ``ends[e]``, int32), times each expert's ``w[e]`` ``[N, K]``
    transposed -> ``[R, N]``; ``torch._grouped_mm`` (CUTLASS on Hopper, which takes bf16
    only: other dtypes on CUDA multiply every row by every expert and keep each row's own,
    E times the work but the same static shapes). With ``scale`` (``[E, N]`` float32: fp8
    codes' per-row scales) ``w`` is dequantized to ``a``'s dtype first (the reference:
    every expert widened on each call)."""
    if scale is not None:
        w = (w.float() * scale.unsqueeze(-1)).to(a.dtype)
    if a.is_cuda and a.dtype != torch.bfloat16:
        group = torch.searchsorted(ends, torch.arange(a.shape[0], device=a.device,
                                                       dtype=ends.dtype), right=True)
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        for e in range(w.shape[0]):
            out = torch.where((group == e).unsqueeze(1), a @ w[e].T, out)
        return out
    return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)


def _quantized(y: torch.Tensor, static_scale: torch.Tensor | None, group: int | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``y``'s rows quantized per token (``quant.fp8.quantize_per_row``), with a static
    scale (``quantize_static``) or per ``group`` columns (``quantize_per_group``), and its
    dtype."""
    y2 = y.reshape(-1, y.shape[-1])
    if group is not None:
        q, s = quantize_per_group(y2, group)
    elif static_scale is not None:
        q, s = quantize_static(y2, static_scale)
    else:
        q, s = quantize_per_row(y2)
    return q, s, y.dtype


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 static_scale: torch.Tensor | None = None, group: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``rms_norm`` quantized (per token, with ``static_scale``, or per ``group``
    columns): ``(q, scale, the norm's dtype)``; the reference of the fused W8A8
    producers."""
    return _quantized(rms_norm(x, weight, eps), static_scale, group)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, sum_out: torch.Tensor | None = None,
                     static_scale: torch.Tensor | None = None, group: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.Tensor]:
    """``add_rms_norm`` with the normed rows quantized (per token, with ``static_scale``,
    or per ``group`` columns): ``(q, scale, dtype, x + residual)`` (the sum in ``sum_out``
    when given)."""
    y, summed = add_rms_norm(x, residual, weight, eps, sum_out)
    return (*_quantized(y, static_scale, group), summed)


def silu_and_mul_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                     group: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``silu_and_mul`` quantized (per token, with ``static_scale``, or per ``group``
    columns): ``(q, scale, dtype)``."""
    return _quantized(silu_and_mul(x), static_scale, group)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    xr, xpass = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((out, xpass), dim=-1) if xpass.numel() else out


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``."""
    cs = cos_sin_cache[positions]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -448, 448))`` (round to nearest even): saturates, never NaN
    for finite ``x``. ``scale`` is a float32 scalar tensor."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (exact products of e4m3 values rounded once)."""
    return q.float() * scale


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantize_kv(x, scale) if is_fp8(cache.dtype) else x.to(cache.dtype)


def _unit(scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``scale``, or unit scales (tests and tools; the model always passes its own)."""
    if scale is not None:
        return scale
    return torch.ones(2, dtype=torch.float32, device=like.device)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's K/V into its slot in the cache's dtype (FP8: scaled by
    ``kv_scale`` and saturated); negative slots (padding) are skipped."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    scale = _unit(kv_scale, k_cache)
    k_cache.view(nb * bs, h, d)[slots] = _to_cache(k[keep], k_cache, scale[0])
    v_cache.view(nb * bs, h, d)[slots] = _to_cache(v[keep], v_cache, scale[1])


class HeadNorm(NamedTuple):
    """Qwen3's (and Gemma 3's) RMSNorm of every query and key head over ``head_dim``
    before RoPE: one weight ``[head_dim]`` for all q heads, one for all k heads
    (``rms_norm`` semantics; ``unit_offset``: Gemma's ``1 + w``)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def rope_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None, hadamard: bool = False,
    head_norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_norm`` on each q and k head when given, RoPE on q and k (then, with
    ``hadamard``, each head times ``H / sqrt(D)``: ``model/kv_hadamard``), then the K/V
    cache write; returns the rotated ``(q, k)``."""
    if head_norm is not None:
        q = rms_norm(q, head_norm.q_weight, head_norm.eps, head_norm.unit_offset)
        k = rms_norm(k, head_norm.k_weight, head_norm.eps, head_norm.unit_offset)
    q, k = rope(q, k, positions, cos_sin_cache)
    if hadamard:
        q, k = hadamard_rotate(q), hadamard_rotate(k)
    write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q, k


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    return cache[blocks].reshape(nblocks * bs, *cache.shape[2:])[:length]


def _read(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows as values: FP8 dequantized to float32, others as stored."""
    return dequantize_kv(x, scale) if is_fp8(x.dtype) else x


def check_softcap(softcap: float | None) -> None:
    """ValueError unless ``softcap`` is None (off) or a finite number > 0."""
    if softcap is not None and not 0 < softcap < float("inf"):  # NaN fails too
        raise ValueError(f"the attention logit softcap must be a finite number > 0 "
                         f"(None: off), got {softcap!r}")


def _softcapped_prefill(qi: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int,
                        scale: float, window: int | None, softcap: float) -> torch.Tensor:
    """One prefill sequence's attention with capped logits, as transformers' eager
    attention: float32 scores ``qi [Hq, n, D] . k [L, Hq, D]`` times ``scale``, capped,
    causally (and ``window``) masked, softmax, times ``v``; returns ``[Hq, n, D]`` in
    float32."""
    length = k.shape[0]
    scores = torch.einsum("hqd,khd->hqk", qi.float(), k.float()) * scale
    scores = torch.tanh(scores / softcap) * softcap
    pos_q = torch.arange(ctx, length, device=qi.device)[:, None]
    keys = torch.arange(length, device=qi.device)[None, :]
    mask = keys <= pos_q
    if window is not None:
        mask &= keys > pos_q - window
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->hqd", probs, v.float())


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, kv_scale: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached context; with a
    sliding ``window`` W, a token at position p over positions p - W + 1 .. p only; with
    ``softcap`` c (Gemma 2's ``attn_logit_softcapping``; None: off, else > 0) every logit
    ``s = q.k * scale`` becomes ``c * tanh(s / c)`` before the mask and the softmax.

    ``q`` is ``[T, Hq, D]``; the K/V of the new tokens must already be in the cache.
    Decodes are batched (padded to the longest context); prefills run per sequence (with
    ``softcap``, their scores, softmax and P.V in float32, as transformers' eager attention
    computes them in a float32 model). An FP8 cache is dequantized (``q * kv_scale``) to
    float32 as it is gathered, then used exactly as a float32 cache holding those values.
    """
    check_softcap(softcap)
    kv_scale = _unit(kv_scale, k_cache)
    k_scale, v_scale = kv_scale[0], kv_scale[1]
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    seq_lens = meta.seq_lens.tolist()
    starts = meta.query_start_loc.tolist()
    nd = meta.num_decodes
    if nd:
        maxlen = max(seq_lens[:nd])
        bs = k_cache.shape[1]
        nblocks = (maxlen + bs - 1) // bs
        # entries past a shorter sequence's blocks are padding: clamp them to a valid id
        # (what they point at is masked out below)
        blocks = meta.block_tables[:nd, :nblocks].long().clamp(0, k_cache.shape[0] - 1)
        k = _read(k_cache[blocks].flatten(1, 2)[:, :maxlen], k_scale)  # [nd, L, Hkv, D]
        v = _read(v_cache[blocks].flatten(1, 2)[:, :maxlen], v_scale)
        qd = q[:nd].float().view(nd, hkv, group, -1)
        scores = torch.einsum("bhgd,blhd->bhgl", qd, k.float()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        lens = meta.seq_lens[:nd].to(scores.device)
        keys = torch.arange(maxlen, device=scores.device)[None, :]
        valid = keys < lens[:, None]
        if window is not None:
            valid &= keys >= lens[:, None] - window
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1)
        v = torch.where(valid[:, :, None, None], v.float(), 0.0)  # padding slots: never NaN
        o = torch.einsum("bhgl,blhd->bhgd", probs, v)
        out[:nd] = o.reshape(nd, hq, -1).to(q.dtype)
    for i in range(nd, meta.num_seqs):
        s, e, length = starts[i], starts[i + 1], seq_lens[i]
        qlen = e - s
        k = _read(_gather_context(k_cache, meta.block_tables[i], length), k_scale)
        v = _read(_gather_context(v_cache, meta.block_tables[i], length), v_scale)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qi = q[s:e].transpose(0, 1)  # [Hq, qlen, D]
        ctx = length - qlen
        if softcap is not None:
            o = _softcapped_prefill(qi, k, v, ctx, scale, window, softcap).to(q.dtype)
        elif ctx == 0 and (window is None or window >= length):
            o = F.scaled_dot_product_attention(
                qi, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                is_causal=True, scale=scale)
        else:
            pos_q = torch.arange(ctx, length, device=q.device)[:, None]
            keys = torch.arange(length, device=q.device)[None, :]
            mask = keys <= pos_q
            if window is not None:
                mask &= keys > pos_q - window
            o = F.scaled_dot_product_attention(
                qi, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
