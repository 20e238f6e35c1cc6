"""The model's shape, read from a Hugging Face ``config.json`` (or GGUF metadata), frozen.

Which architectures are supported is the registry's business (``model/registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        """Raises a clear error when the heads cannot be split over ``tp`` ranks."""
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        kv = self.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            problems.append(f"num_key_value_heads={kv} (tp must divide it or be a multiple)")
        if self.intermediate_size % tp:
            problems.append(f"intermediate_size={self.intermediate_size}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide the model: "
                             + "; ".join(problems))

    def kv_heads_for(self, tp: int) -> int:
        """KV heads each rank holds (replicated heads count once per rank)."""
        return max(self.num_key_value_heads // tp, 1)

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
