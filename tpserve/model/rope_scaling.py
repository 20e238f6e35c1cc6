"""RoPE scaling as a ``config.json`` (or a GGUF file's metadata) names it: ``RopeScaling``,
built once by ``build_rope_scaling`` as transformers computes it, and the rotated dims of
each head (``rotary_dim_from_hf``); ``layers/rotary.py`` builds the tables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# the RoPE types a config.json may name; every other one ("dynamic", "mrope", ...) refused
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_scaling`` / ``rope_parameters``), as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute it; ``layers/rotary.py`` builds the tables.

    - ``linear``: every frequency divided by ``factor`` (positions divided by it).
    - ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth blend
      between (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    - ``yarn``: frequencies that turn more than ``beta_fast`` times over
      ``original_max_position_embeddings`` kept, fewer than ``beta_slow`` times divided by
      ``factor``, a linear ramp over the pair index between (its ends rounded outwards with
      ``truncate``); cos and sin both multiplied by ``attention_factor``.
    - ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini): each pair's frequency divided by its
      ``short_factor`` entry, cos and sin multiplied by ``attention_factor`` (by default
      ``sqrt(1 + ln(factor) / ln(original))``, ``factor`` by default max_position_embeddings
      / ``original_max_position_embeddings``). transformers switches every position of a
      sequence to the ``long_factor`` entries once it is longer than the original context
      (recomputing its cache), which one static table cannot do: the context is capped at
      ``original_max_position_embeddings`` (``runner_config.model_context``), where the
      short factors are exactly transformers' RoPE. ``long_factor`` is kept, checked, unused.
    - ``freq_factors``: each pair's frequency divided by its own ``freq_factors`` entry (one
      per rotated pair; ``factor`` is 1). Never named by a ``config.json``: it is how a
      GGUF file carries Llama-3's scaling (llama.cpp's ``rope_freqs.weight`` tensor).
    ``attention_factor`` is resolved when the config is read and is 1 for the other types.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # yarn, longrope
    freq_factors: tuple[float, ...] | None = None  # freq_factors
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope

    def per_pair_factors(self) -> tuple[tuple[str, tuple[float, ...]], ...]:
        """The per-rotated-pair lists this scaling carries, by name (their length must be
        the rotary dim / 2)."""
        named = (("freq_factors", self.freq_factors), ("short_factor", self.short_factor),
                 ("long_factor", self.long_factor))
        return tuple((name, f) for name, f in named if f is not None)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 at factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(factor: float, mscale: float | None,
                           mscale_all_dim: float | None) -> float:
    """The magnitude of YaRN's cos and sin when the config sets no ``attention_factor``: with
    both ``mscale`` and ``mscale_all_dim`` (DeepSeek's fields) the ratio of their two
    corrections (1 when they are equal), else the correction at mscale 1. Either field alone
    (or a zero) is ignored, as transformers ignores it."""
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_scaling_from_hf(d: dict[str, Any], params: dict[str, Any]) -> RopeScaling | None:
    """``params`` (``rope_scaling`` or ``rope_parameters``) of the ``config.json`` ``d`` ->
    the scaling; None for plain RoPE. ``rope_type`` or the legacy ``type`` names it.

    As transformers standardises it: a top-level ``original_max_position_embeddings``
    (Phi-3 keeps it there) wins over the parameters'; Phi-3's old names ``su`` (and, in a
    Phi-3 config, ``yarn``) are ``longrope``, as ``Phi3Config`` reads them.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if rope_type == "su" or (rope_type == "yarn" and d.get("model_type") == "phi3"):
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    if d.get("original_max_position_embeddings"):
        params = {**params,
                  "original_max_position_embeddings": d["original_max_position_embeddings"]}
    return build_rope_scaling(rope_type, params, int(d.get("max_position_embeddings", 4096)))


def build_rope_scaling(rope_type: str, params: dict[str, Any],
                       max_positions: int) -> RopeScaling:
    """The one builder of a ``RopeScaling`` (``config.json`` and GGUF metadata alike):
    ``params`` in transformers' keys (``factor``, ``original_max_position_embeddings``,
    ``low_freq_factor``, ``high_freq_factor``, ``beta_fast``, ``beta_slow``, ``truncate``,
    ``attention_factor``, ``mscale``, ``mscale_all_dim``; ``freq_factors`` for that type),
    ``max_positions`` the model's ``max_position_embeddings``.

    As transformers computes them: without ``original_max_position_embeddings`` it is
    ``max_positions``; a YaRN ``factor`` of null is max_positions / original; ``beta_fast``
    / ``beta_slow`` of null or 0 are 32 / 1; a YaRN ``attention_factor`` of null is derived
    from ``factor`` (and ``mscale`` / ``mscale_all_dim``).
    """
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "freq_factors":
        return RopeScaling(rope_type="freq_factors", factor=1.0,
                           freq_factors=tuple(float(f) for f in params["freq_factors"]))
    original = int(params.get("original_max_position_embeddings") or max_positions)
    if rope_type == "llama3":
        return RopeScaling(rope_type="llama3", factor=float(params["factor"]),
                           original_max_position_embeddings=original,
                           low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]))
    if rope_type == "longrope":
        return _longrope(params, original, max_positions)
    if rope_type != "yarn":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = _yarn_attention_factor(factor, params.get("mscale"),
                                           params.get("mscale_all_dim"))
    return RopeScaling(rope_type="yarn", factor=factor,
                       original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=float(attention))


def _longrope(params: dict[str, Any], original: int, max_positions: int) -> RopeScaling:
    """``longrope`` as transformers' ``_compute_longrope_parameters`` reads it: ``factor``
    of null is max_positions / original, an ``attention_factor`` of null is
    ``sqrt(1 + ln(factor) / ln(original))`` (1 at factor <= 1)."""
    lists = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or not value:
            raise ValueError(f"rope scaling type 'longrope' needs a list {key!r}, got "
                             f"{value!r}")
        lists[key] = tuple(float(f) for f in value)
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor,
                       original_max_position_embeddings=original,
                       attention_factor=float(attention), **lists)


def rotary_dim_from_hf(d: dict[str, Any], rope_params: dict[str, Any], head_dim: int) -> int:
    """The leading dims of each head that RoPE rotates: ``int(head_dim *
    partial_rotary_factor)``, the factor read as transformers reads it (the RoPE
    parameters' own, else the top-level key; Phi-4-mini: 0.75; absent or null: 1). The
    rest of the head passes through unrotated.

    Read for every architecture, as vLLM's Llama reads it (transformers' Llama, Qwen2,
    Qwen3 and Mistral ignore it under plain RoPE)."""
    factor = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    return head_dim if factor is None else int(head_dim * float(factor))

