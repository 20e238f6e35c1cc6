"""The model's shape, read from a Hugging Face ``config.json`` (or GGUF metadata), frozen.

Which architectures are supported is the registry's business (``model/registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpserve.parallel.heads import HeadLayout
from tpserve.parallel.shard import padded_split


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises a clear error for a ``tp`` the model cannot be sharded over.

        Head counts and the MLP width need not divide by tp: ``head_layout`` and
        ``intermediate_per_rank`` pad them with zero heads/columns (the function is
        unchanged), so any ``tp >= 1`` is served; ``describe_padding`` states the cost.
        """
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
        self.head_layout(tp)  # raises if the heads do not form GQA groups

    def head_layout(self, tp: int) -> HeadLayout:
        """The attention heads over ``tp`` ranks, zero-padded where they do not divide."""
        return HeadLayout.plan(self.num_attention_heads, self.num_key_value_heads, tp)

    def intermediate_per_rank(self, tp: int) -> int:
        """MLP columns per rank (zero-padded to ``ceil(intermediate_size / tp)``)."""
        return padded_split(self.intermediate_size, tp)

    def kv_heads_for(self, tp: int) -> int:
        """KV heads each rank holds, padding included (replicated heads count once per
        rank): what the KV pool is sized by."""
        return self.head_layout(tp).kv_heads_per_rank

    def describe_padding(self, tp: int) -> str | None:
        """One line on the zero padding at ``tp`` and its cost; None when nothing is padded."""
        layout = self.head_layout(tp)
        inter = self.intermediate_per_rank(tp) * tp
        parts = [layout.describe()] if layout.padded else []
        if inter != self.intermediate_size:
            parts.append(f"MLP width {self.intermediate_size} -> {inter} "
                         f"(+{inter / self.intermediate_size - 1:.1%} MLP FLOPs)")
        if not parts:
            return None
        return "; ".join(parts) if layout.padded else f"tp {tp}: padding " + parts[0]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed ``config.json``."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture ('architectures' is empty)")
        arch = archs[0]
        heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or {}
        scaling_d = d.get("rope_scaling") or rope_params
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_type = scaling_d.get("rope_type", scaling_d.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                float(scaling_d["factor"]), float(scaling_d["low_freq_factor"]),
                float(scaling_d["high_freq_factor"]),
                int(scaling_d["original_max_position_embeddings"]))
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            rope_scaling=scaling,
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
