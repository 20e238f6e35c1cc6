"""Reference ops in plain torch: the CPU path and the oracle every GPU kernel is tested against.

KV cache layout (one layer): ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; flat slot ``s`` is block
``s // block_size``, offset ``s % block_size``.
RoPE cache layout: ``cos_sin_cache`` is ``[max_positions, rotary_dim]`` float32, the first
half cosines and the second half sines (rotate-half / "neox" pairing, as Hugging Face Llama).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.model.attention.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight (as Hugging Face does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


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


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's K/V into its slot; negative slots (padding) are skipped."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(nb * bs, h, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slots] = v[keep].to(v_cache.dtype)


def rope_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k, then the K/V cache write; returns the rotated ``(q, k)``."""
    q, k = rope(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    return cache[blocks].reshape(nblocks * bs, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached context.

    ``q`` is ``[T, Hq, D]``; the K/V of the new tokens must already be in the cache.
    Decodes are batched (padded to the longest context); prefills run per sequence.
    """
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
        k = k_cache[blocks].flatten(1, 2)[:, :maxlen]  # [nd, L, Hkv, D]
        v = v_cache[blocks].flatten(1, 2)[:, :maxlen]
        qd = q[:nd].float().view(nd, hkv, group, -1)
        scores = torch.einsum("bhgd,blhd->bhgl", qd, k.float()) * scale
        lens = meta.seq_lens[:nd].to(scores.device)
        valid = torch.arange(maxlen, device=scores.device)[None, :] < lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1)
        v = torch.where(valid[:, :, None, None], v.float(), 0.0)  # padding slots: never NaN
        o = torch.einsum("bhgl,blhd->bhgd", probs, v)
        out[:nd] = o.reshape(nd, hq, -1).to(q.dtype)
    for i in range(nd, meta.num_seqs):
        s, e, length = starts[i], starts[i + 1], seq_lens[i]
        qlen = e - s
        k = _gather_context(k_cache, meta.block_tables[i], length)
        v = _gather_context(v_cache, meta.block_tables[i], length)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qi = q[s:e].transpose(0, 1)  # [Hq, qlen, D]
        ctx = length - qlen
        if ctx == 0:
            o = F.scaled_dot_product_attention(
                qi, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                is_causal=True, scale=scale)
        else:
            pos_q = torch.arange(ctx, length, device=q.device)[:, None]
            mask = torch.arange(length, device=q.device)[None, :] <= pos_q
            o = F.scaled_dot_product_attention(
                qi, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
                attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1)
    return out
