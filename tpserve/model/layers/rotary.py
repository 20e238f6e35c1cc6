"""Rotary position embedding tables, with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from tpserve.model.config import RopeScaling


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(dim: int, max_positions: int, theta: float,
                  scaling: RopeScaling | None) -> torch.Tensor:
    """``[max_positions, dim]`` float32: cosines in the first half, sines in the second."""
    inv = inverse_frequencies(dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
