"""Rotary position embedding tables: plain, or scaled as ``RopeScaling`` says (linear,
Llama-3, YaRN, LongRoPE's short factors, each computed in transformers' float32
operations and order, so the tables equal its cos/sin; or per-pair frequency divisors, as
llama.cpp applies a GGUF file's ``rope_freqs.weight``).

A table covers the ``dim`` leading dims of each head that RoPE rotates (the model's
``rotary_dim``: the whole head unless ``partial_rotary_factor`` says less); the kernels
pass the rest of the head through unrotated."""

from __future__ import annotations

import math

import torch

from tpserve.model.rope_scaling import RopeScaling


def _powers(dim: int, theta: float) -> torch.Tensor:
    """``theta ** (2i / dim)`` for each rotated pair ``i``: one over its frequency."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths above ``original / low_freq_factor`` divided by ``factor``, below
    ``original / high_freq_factor`` kept, a smooth blend between."""
    old = s.original_max_position_embeddings
    low_wavelen = old / s.low_freq_factor
    high_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_pair(turns: float, dim: int, theta: float, context: int) -> float:
    """The (fractional) pair index whose frequency makes ``turns`` full turns over
    ``context`` positions."""
    return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Pairs below the ramp (fast: more than ``beta_fast`` turns over the original context)
    keep their frequency, pairs above it (fewer than ``beta_slow`` turns) are divided by
    ``factor``, linearly blended across it. Subtle, but transformers' (and the paper's
    code's): the ramp's upper end is clamped to ``dim - 1``, not to the last pair, and
    ``truncate`` floors / ceils its ends before clamping."""
    context = s.original_max_position_embeddings
    low = _yarn_pair(s.beta_fast, dim, theta, context)
    high = _yarn_pair(s.beta_slow, dim, theta, context)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair's own frequency, 0: divided by factor
    powers = _powers(dim, theta)
    return 1.0 / (s.factor * powers) * (1 - keep) + 1.0 / powers * keep


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``dim // 2`` float32 frequencies (radians per position) of the rotated pairs."""
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn(dim, theta, scaling)
    inv = 1.0 / _powers(dim, theta)
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv, scaling)
    if scaling.rope_type in ("freq_factors", "longrope"):
        factors = (scaling.freq_factors if scaling.rope_type == "freq_factors"
                   else scaling.short_factor) or ()
        if len(factors) != dim // 2:
            raise ValueError(f"{len(factors)} RoPE frequency factors for a head of {dim} "
                             f"({dim // 2} rotated pairs)")
        if scaling.rope_type == "longrope":  # transformers' order: 1 / (factor * theta**x)
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * _powers(dim, theta))
        return inv / torch.tensor(factors, dtype=torch.float32)
    raise ValueError(f"rope scaling type {scaling.rope_type!r} has no table")


def cos_sin_cache(dim: int, max_positions: int, theta: float,
                  scaling: RopeScaling | None) -> torch.Tensor:
    """``[max_positions, dim]`` float32: cosines in the first half, sines in the second.

    With YaRN and LongRoPE both are multiplied by ``attention_factor``: the kernels rotate
    q and k by the table as read, so every q.k score grows by its square, as in
    transformers (which scales its cos and sin the same way).

    A LongRoPE table holds at most ``original_max_position_embeddings`` positions: there
    transformers uses the short factors for every position of a sequence, past it the long
    ones for every position (the cached keys' included), which no static table does."""
    if (scaling is not None and scaling.rope_type == "longrope"
            and max_positions > scaling.original_max_position_embeddings):
        raise ValueError(
            f"a LongRoPE model is served up to its original_max_position_embeddings "
            f"({scaling.original_max_position_embeddings} tokens), not {max_positions}: "
            "past it transformers switches the whole sequence, cached keys included, to "
            "the long factors, which tpserve's static RoPE table cannot do")
    inv = inverse_frequencies(dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    magnitude = scaling.attention_factor if scaling is not None else 1.0
    return cache if magnitude == 1.0 else cache * magnitude
