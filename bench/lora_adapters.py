"""Random LoRA adapters of a model's shape, written as PEFT saves them (for the engine
bench's ``--lora-adapters``; no PEFT needed): rank ``r`` on all seven projections of every
layer, ``lora_alpha`` = r (scale 1), bf16, A and B of std 0.02."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tpserve.model.config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's ``(out, in)`` as the checkpoint stores it."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_random_adapters(cfg: ModelConfig, count: int, rank: int, folder: Path,
                          seed: int = 0) -> list[Path]:
    """``count`` adapter folders under ``folder`` (``lora-0``, ...)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(cfg)
    folders = []
    for i in range(count):
        out = folder / f"lora-{i}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for proj, (rows, cols) in shapes.items():
                part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{name}.lora_A.weight"] = (
                    torch.randn(rank, cols, generator=gen) * 0.02).bfloat16()
                tensors[f"{name}.lora_B.weight"] = (
                    torch.randn(rows, rank, generator=gen) * 0.02).bfloat16()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank,
            "target_modules": list(PROJECTIONS), "bias": "none"}))
        folders.append(out)
    return folders
