"""Dummy random weights of real model shapes (no files needed), for benchmarks."""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from tpserve.model.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES = ("llama3-8b", "llama3-70b", "smollm2-135m")


def shape_config(name: str) -> ModelConfig:
    """The model config of a named shape."""
    return ModelConfig.from_hf(shape_hf_config(name))


def shape_hf_config(name: str) -> dict:
    """The Hugging Face ``config.json`` contents of a named shape."""
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
    if name == "llama3-8b":
        d = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 rope_theta=500000.0, max_position_embeddings=131072,
                 rope_scaling=dict(_LLAMA3_ROPE), eos_token_id=[128001, 128009])
    elif name == "llama3-70b":
        d = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 rope_theta=500000.0, max_position_embeddings=131072,
                 rope_scaling=dict(_LLAMA3_ROPE), eos_token_id=[128001, 128009])
    elif name == "smollm2-135m":
        d = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                 eos_token_id=2)
    else:
        raise ValueError(f"unknown dummy shape {name!r}; choose one of {', '.join(SHAPES)}")
    return {**base, **d}


def fill_random(model: nn.Module, seed: int, show_progress: bool) -> None:
    """Fills every parameter in place on its device: norms with ones, the rest with small
    normal noise (std 0.02), so no full host copy of any weight is ever made."""
    params = list(model.named_parameters())
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in tqdm(params, desc="Initialising dummy weights", unit="tensor",
                            disable=not show_progress, leave=False):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, 0.02, generator=g)
