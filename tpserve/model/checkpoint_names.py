"""Hugging Face checkpoint names onto the Llama-family module's parameter names
(``llama.LlamaForCausalLM.load_weights``), and the small checks loading makes on values.

Our names are Hugging Face's causal LM's, except the fused ``qkv_proj`` and
``gate_up_proj`` (``STACKED``). ``model_name`` maps every other difference: a base model's
file, a multimodal checkpoint's language model, Mixtral's and Granite-MoE's expert names.
"""

from __future__ import annotations

import torch

from tpserve.model.layers.moe import checkpoint_name
from tpserve.parallel.shard import TensorSource, as_source

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# fused parameters a checkpoint may store as one tensor, every part stacked along dim 0
FUSED = (".qkv_proj.", ".gate_up_proj.")
# a base model's checkpoint (saved from e.g. ``Qwen3Model``, as Qwen3-Embedding's are)
# names its tensors without the ``model.`` of the causal LM
BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# a multimodal checkpoint's language model (``families.LANGUAGE_MODEL_OF``: Gemma 3 4B and
# up), as transformers 4 and 5 name it -> our names; its vision tower and projector are not
# loaded
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head."}
NOT_LANGUAGE_MODEL = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector.")


def model_name(name: str, multimodal: bool) -> str | None:
    """A checkpoint tensor's name in the model before ``STACKED`` fuses it, or None for a
    tensor the model never loads (rotary tables; a multimodal checkpoint's vision tower
    and projector)."""
    if "rotary_emb" in name:
        return None
    if multimodal:
        if name.startswith(NOT_LANGUAGE_MODEL):
            return None
        for theirs, ours in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
    if name.startswith(BASE_MODEL_PREFIXES):  # a base model's file (Qwen3-Embedding)
        name = "model." + name
    return checkpoint_name(name)  # Mixtral's and Granite-MoE's names


def stacked_name(name: str) -> tuple[str, str | int | None]:
    """``(fused parameter name, shard id)`` for a part of a fused parameter, else
    ``(name, None)``."""
    for frag, (fused, sid) in STACKED.items():
        if frag in name:
            return name.replace(frag, fused), sid
    return name, None


def stacked_parts(name: str) -> list[str]:
    """The names before fusing of a fused parameter's parts (``STACKED``; the inverse of
    ``stacked_name``): ``...qkv_proj.weight`` -> its q, k and v_proj names; [] for any
    other parameter."""
    return [name.replace(fused, frag) for frag, (fused, _) in STACKED.items()
            if fused in name]


def is_zero(source: TensorSource) -> bool:
    """Whether every element of ``source`` is zero (AutoGPTQ's zero biases)."""
    return not bool(as_source(source).read().any())


def load_kv_scale(kv_scale: torch.Tensor, entries: tuple[int, ...], value: torch.Tensor,
                  name: str) -> None:
    """One checkpoint KV scale (a one-element tensor) into a layer's ``kv_scale``."""
    if value.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be one value "
                         f"per layer, got shape {tuple(value.shape)}")
    scale = value.reshape(()).float()
    if not (torch.isfinite(scale) and scale > 0):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be finite and "
                         f"> 0, got {scale.item()}")
    for i in entries:
        kv_scale[i] = scale
