"""The model's shape, read from a Hugging Face ``config.json`` (or GGUF metadata), frozen.

Which architectures are supported is the registry's business (``model/registry.py``); what
each family changes in the reading is ``model/families.py``'s, RoPE scaling
``model/rope_scaling.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tpserve.model.families import (
    COMPLETED_BY_TRANSFORMERS,
    GEMMA_ARCHITECTURES,
    HIDDEN_ACTS,
    MOE_ARCHITECTURES,
    SEQUENCE_CLASSIFIERS,
    architecture_family,
    classifier_labels,
    classifier_problem_type,
    completed_config,
    gemma_fields,
    granite_fields,
    moe_fields,
    token_classifier,
)
from tpserve.model.rope_scaling import RopeScaling, rope_scaling_from_hf, rotary_dim_from_hf
from tpserve.parallel.heads import HeadLayout
from tpserve.parallel.moe import expert_width_per_rank
from tpserve.parallel.shard import padded_split


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
    # Qwen3: an RMSNorm over each query and key head (weights [head_dim], shared by the
    # heads) between the q/k projections and RoPE
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    # sliding-window attention: a query at position p sees keys at positions > p - W (W
    # keys, itself included), as transformers masks; ``full_attention_layers`` see all
    # (Qwen2/Qwen3's ``max_window_layers``, or ``layer_types``' "full_attention")
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    # --disable-sliding-window: the window is off and caps the context instead (vLLM's rule)
    context_cap: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the leading dims of each head that RoPE rotates (``partial_rotary_factor``); None:
    # the whole head (set to ``head_dim`` on construction)
    rotary_dim: int | None = None
    # an embedding model trained for shorter vectors (config.json's ``is_matryoshka`` or
    # ``matryoshka_dimensions``, vLLM's keys): None: a request's ``dimensions`` is refused;
    # (): any size; else those sizes only
    matryoshka_dimensions: tuple[int, ...] | None = None
    # a sequence classifier's labels (``id2label``, in id order; the ``score`` head has one
    # row per label); () for every other model
    labels: tuple[str, ...] = ()
    # a sequence classifier's ``problem_type`` (config.json's, as transformers' Trainer
    # writes it: regression, single_label_classification or multi_label_classification;
    # None: not given): how /classify scores its logits (``PoolerConfig.activation``)
    problem_type: str | None = None
    # a classifier whose head is built from the LM head's rows of these tokens (vLLM's
    # ``classifier_from_token``) by ``classifier_method``: ``from_2_way_softmax`` (two
    # tokens, false then true: one label, the true row less the false one, so its sigmoid
    # is the two-way softmax's true probability) or ``no_post_processing`` (a label per
    # token, its row as it is); () : the checkpoint's own ``score.weight``
    classifier_from_token: tuple[str, ...] = ()
    classifier_method: str | None = None
    # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU, GeLU's tanh form)
    hidden_act: str = "silu"
    # Gemma: every RMSNorm scales by ``1 + w`` in float32 (the checkpoint stores ``w``)
    norm_unit_offset: bool = False
    # Gemma: the embedding's output times sqrt(hidden_size) (rounded to the model's dtype)
    embed_scale: float | None = None
    # SmolLM3's NoPE layers: no rotary embedding at all (the others rotate as usual)
    nope_layers: tuple[int, ...] = ()
    # Granite's multipliers: the embedding's output, each attention and MLP output before
    # its residual add, and the logits' divisor (``logits_scaling``); 1: none
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Gemma 2/3: a norm after attention and after the MLP as well as before each
    # ("post_attention_layernorm" is then the attention output's norm)
    sandwich_norms: bool = False
    # the attention logits' scale (Gemma 2/3: query_pre_attn_scalar ** -0.5); None:
    # head_dim ** -0.5
    attention_scale: float | None = None
    # Gemma 2: ``cap * tanh(x / cap)`` of the attention logits / of the final logits
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma 3: the sliding-window layers' own RoPE base and scaling (the full layers take
    # ``rope_theta`` / ``rope_scaling``) and the layers that take it (fixed by the layers'
    # types, so ``--disable-sliding-window`` keeps each layer's RoPE)
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    local_rope_layers: tuple[int, ...] = ()
    # a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): each of ``moe_layers``' MLPs
    # is ``num_experts`` gated MLPs ``moe_intermediate_size`` wide, each token through the
    # ``num_experts_per_tok`` a router (a softmax over the experts) picks, weighted by
    # their probabilities (renormalized to sum 1 with ``norm_topk_prob``); plus, with
    # ``shared_expert_intermediate_size``, a shared MLP every token takes, gated by a
    # sigmoid (Qwen2-MoE). The other layers' MLPs are dense. 0 experts: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()

    def without_sliding_window(self) -> ModelConfig:
        """``--disable-sliding-window``: every layer attends to everything, and the context
        is capped at the window (as vLLM does); unchanged without a window."""
        if self.sliding_window is None:
            return self
        return replace(self, sliding_window=None, full_attention_layers=(),
                       context_cap=self.sliding_window)

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None where it attends to the whole context."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return layer in self.moe_layers

    def mlp_activation_columns(self, tp: int) -> int:
        """Columns per token of an MLP's largest live activations on one rank (a dense
        MLP's gate/up output and its product, three per column; an expert layer's per
        routed copy of a token: its row, gate/up output and product, its output and that
        output unsorted), for the CPU's activation estimate."""
        dense = 3 * self.intermediate_per_rank(tp)
        if not self.num_experts:
            return dense
        moe = (self.num_experts_per_tok * (3 * expert_width_per_rank(self.moe_intermediate_size,
                                                                     tp)
                                           + 3 * self.hidden_size)
               + 3 * padded_split(self.shared_expert_intermediate_size, tp))
        return max(moe, dense if len(self.moe_layers) < self.num_hidden_layers else 0)

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with the local RoPE (Gemma 3's windowed layers)."""
        return layer in self.local_rope_layers

    def __post_init__(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS.values():
            raise ValueError(f"hidden_act {self.hidden_act!r}: choose one of "
                             f"{sorted(set(HIDDEN_ACTS.values()))}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attention_scale",
                     "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"a mixture of {self.num_experts} experts needs 1 to "
                             f"{self.num_experts} experts per token and a positive width; "
                             f"got {self.num_experts_per_tok} and "
                             f"{self.moe_intermediate_size}")
        if self.local_rope_layers and self.local_rope_theta is None:
            raise ValueError("local_rope_layers needs local_rope_theta")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        r = self.rotary_dim
        if not (2 <= r <= self.head_dim and r % 2 == 0):
            raise ValueError(f"RoPE must rotate an even number of dims from 2 to the head's "
                             f"{self.head_dim}; partial_rotary_factor gives {r}")
        for name, factors in (self.rope_scaling.per_pair_factors()
                              if self.rope_scaling is not None else ()):
            if len(factors) != r // 2:
                raise ValueError(f"rope scaling {self.rope_scaling.rope_type!r}: {name} has "
                                 f"{len(factors)} entries; RoPE rotates {r} dims of each "
                                 f"head, {r // 2} pairs")

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
        if inter != self.intermediate_size and len(self.moe_layers) < self.num_hidden_layers:
            parts.append(f"MLP width {self.intermediate_size} -> {inter} "
                         f"(+{inter / self.intermediate_size - 1:.1%} MLP FLOPs)")
        expert = expert_width_per_rank(self.moe_intermediate_size, tp) * tp
        if self.num_experts and expert != self.moe_intermediate_size:
            parts.append(f"expert width {self.moe_intermediate_size} -> {expert} "
                         f"(+{expert / self.moe_intermediate_size - 1:.1%} expert FLOPs)")
        if not parts:
            return None
        return "; ".join(parts) if layout.padded else f"tp {tp}: padding " + "; ".join(parts)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed ``config.json``."""
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture ('architectures' is empty)")
        arch = archs[0]
        family = architecture_family(arch)
        if family in COMPLETED_BY_TRANSFORMERS:
            d = completed_config(d, arch, family)
        gemma = gemma_fields(d, family) if family in GEMMA_ARCHITECTURES else {}
        if gemma:
            d = {**d, "layer_types": gemma.pop("layer_types")}
        if family == "GraniteForCausalLM":
            gemma = granite_fields(d)
        heads = d["num_attention_heads"]
        rope_params = d.get("rope_parameters") or {}
        if "full_attention" in rope_params:  # per layer type (Gemma 3): the full layers'
            rope_params = rope_params["full_attention"] or {}
        scaling_d = d.get("rope_scaling") or rope_params
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = rope_scaling_from_hf(d, scaling_d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Phi-3 has no biases whatever its config says (transformers ignores the key)
        attention_bias = bool(d.get("attention_bias", False)) and family != "Phi3ForCausalLM"
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        # transformers' Llama has no sliding window; Qwen's only with use_sliding_window
        qwen = family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")
        window = (d.get("sliding_window") if d.get("use_sliding_window", not qwen)
                  and family not in ("LlamaForCausalLM", "GemmaForCausalLM") else None) or None
        act = "silu" if gemma else d.get("hidden_act", "silu")  # Gemma's: gemma_fields
        if act not in HIDDEN_ACTS:
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (supported: "
                             f"{', '.join(HIDDEN_ACTS)})")
        fields = dict(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=family == "Qwen2ForCausalLM" or attention_bias,
            nope_layers=tuple(i for i, r in enumerate(d.get("no_rope_layers") or ()) if not r),
            o_bias=attention_bias and family != "Qwen2ForCausalLM",
            qk_norm=family == "Qwen3ForCausalLM",
            rope_scaling=scaling,
            sliding_window=window,
            full_attention_layers=_full_attention_layers(d, family, window),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rotary_dim=rotary_dim_from_hf(d, scaling_d, head_dim),
            matryoshka_dimensions=_matryoshka(d),
            hidden_act=HIDDEN_ACTS[act],
            labels=classifier_labels(d) if arch in SEQUENCE_CLASSIFIERS else (),
            problem_type=classifier_problem_type(d) if arch in SEQUENCE_CLASSIFIERS else None,
        )
        if d.get("classifier_from_token") is not None or d.get("is_original_qwen3_reranker"):
            fields.update(token_classifier(d, arch))
        if arch in MOE_ARCHITECTURES:
            fields.update(moe_fields(d, arch))
        return cls(**{**fields, **gemma})



def _matryoshka(d: dict[str, Any]) -> tuple[int, ...] | None:
    """config.json's Matryoshka keys (see ``ModelConfig.matryoshka_dimensions``)."""
    dims = d.get("matryoshka_dimensions")
    if dims is not None:
        if not (isinstance(dims, list) and all(isinstance(x, int) and x > 0 for x in dims)):
            raise ValueError(f"config.json: matryoshka_dimensions must be a list of positive "
                             f"integers, got {dims!r}")
        return tuple(dims)
    return () if d.get("is_matryoshka") else None


def _full_attention_layers(d: dict[str, Any], family: str, window: int | None
                           ) -> tuple[int, ...]:
    """The layers that ignore the sliding window, as transformers decides: ``layer_types``
    where the config lists them, else for Qwen2/Qwen3 the first ``max_window_layers``."""
    if window is None:
        return ()
    types = d.get("layer_types")
    if types is not None:
        return tuple(i for i, t in enumerate(types) if t != "sliding_attention")
    if family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return tuple(range(min(int(d.get("max_window_layers", 0)), d["num_hidden_layers"])))
    return ()
