"""Architecture string -> model class."""

from __future__ import annotations

from torch import nn

from tpserve.model.families import BASE_ARCHITECTURES, SEQUENCE_CLASSIFIERS
from tpserve.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # fused qkv / gate_up tensors: checkpoint_names.FUSED
    # Gemma's differences are ModelConfig fields (families.gemma_fields)
    "GemmaForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,  # its multipliers: ModelConfig fields
    # mixtures of experts: their MLPs layers.moe.SparseMoeBlock (ModelConfig.moe_layers)
    "MixtralForCausalLM": LlamaForCausalLM,
    "GraniteMoeForCausalLM": LlamaForCausalLM,  # Granite's multipliers too
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # its NoPE layers: ModelConfig.nope_layers
    # its language model alone (checkpoint_names.LANGUAGE_MODEL_PREFIXES; the vision tower skipped)
    "Gemma3ForConditionalGeneration": LlamaForCausalLM,
}
# their checkpoints have no LM head: served by --runner pooling
MODEL_CLASSES.update({base: MODEL_CLASSES[lm] for base, lm in BASE_ARCHITECTURES.items()})
# sequence classifiers: the decoder and a ``score`` head, no LM head (--runner pooling)
MODEL_CLASSES.update({c: MODEL_CLASSES[lm] for c, lm in SEQUENCE_CLASSIFIERS.items()})


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_CLASSES))}") from None
