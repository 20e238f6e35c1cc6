"""The model's shape, read from a Hugging Face ``config.json`` (or GGUF metadata), frozen.

Which architectures are supported is the registry's business (``model/registry.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tpserve.parallel.heads import HeadLayout
from tpserve.parallel.shard import padded_split

# the RoPE types a config.json may name; every other one ("dynamic", "mrope", ...) refused
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# base models (no LM head: embedding models such as e5-mistral) -> their causal LM
BASE_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                      "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the families whose config.json is completed by transformers' config class (its name)
COMPLETED_BY_TRANSFORMERS = {"GemmaForCausalLM": "GemmaConfig",
                             "Gemma2ForCausalLM": "Gemma2Config",
                             "Gemma3ForCausalLM": "Gemma3TextConfig",
                             "SmolLM3ForCausalLM": "SmolLM3Config"}
# a multimodal checkpoint whose language model is served alone (text in, text out) -> the
# causal LM it holds (its ``text_config``)
LANGUAGE_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# sequence classifiers (rerankers, reward models): the decoder and a ``score`` head over the
# last token's hidden state, no LM head -> their causal LM (served by --runner pooling)
SEQUENCE_CLASSIFIERS = {f"{name}ForSequenceClassification": f"{name}ForCausalLM"
                        for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2")}
SEQUENCE_CLASSIFIERS["Gemma3TextForSequenceClassification"] = "Gemma3ForCausalLM"
# vLLM's conversion of a causal LM checkpoint into a classifier by its LM head's rows of
# label tokens (``--hf-overrides``: ``classifier_from_token``, ``method``, Qwen3-Reranker's
# ``is_original_qwen3_reranker``)
TOKEN_CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
# config.json's activation names -> the MLP gates the model runs (gated: act(gate) * up)
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
        family = architecture_family(arch)
        if family in COMPLETED_BY_TRANSFORMERS:
            d = _completed_config(d, arch, family)
        gemma = _gemma_fields(d, family) if family in GEMMA_ARCHITECTURES else {}
        if gemma:
            d = {**d, "layer_types": gemma.pop("layer_types")}
        if family == "GraniteForCausalLM":
            gemma = _granite_fields(d)
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
        act = "silu" if gemma else d.get("hidden_act", "silu")  # Gemma's: _gemma_fields
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
            labels=_labels(d) if arch in SEQUENCE_CLASSIFIERS else (),
        )
        if d.get("classifier_from_token") is not None or d.get("is_original_qwen3_reranker"):
            fields.update(_token_classifier(d, arch))
        return cls(**{**fields, **gemma})


def architecture_family(arch: str) -> str:
    """The causal LM whose flags ``arch`` takes: a base model's (``BASE_ARCHITECTURES``),
    a multimodal checkpoint's language model (``LANGUAGE_MODEL_OF``) or a sequence
    classifier's decoder (``SEQUENCE_CLASSIFIERS``), else itself."""
    return (BASE_ARCHITECTURES.get(arch) or LANGUAGE_MODEL_OF.get(arch)
            or SEQUENCE_CLASSIFIERS.get(arch) or arch)


def _completed_config(d: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
    """A ``config.json`` completed by transformers' own config class, where the hub files
    leave keys to its defaults (Gemma 3 4B's ``text_config`` names five; SmolLM3's NoPE
    layers come from ``no_rope_layer_interval``), in its current form (per-layer-type
    ``rope_parameters``, ``layer_types``, ``no_rope_layers``). A multimodal checkpoint's is
    its ``text_config``, with the outer token ids and tying."""
    import transformers

    if arch in LANGUAGE_MODEL_OF:
        d = {**(d.get("text_config") or {}),
             **{k: d[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings")
                if d.get(k) is not None}}
    cls = getattr(transformers, COMPLETED_BY_TRANSFORMERS[family])
    known = {k: v for k, v in d.items() if k != "model_type"}
    return {**cls(**known).to_dict(), "architectures": [arch]}


def _gemma_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    """What Gemma (1, 2, 3) changes, as transformers' Gemma configs read ``config.json``
    (their defaults where a key is absent), plus ``layer_types`` (the config's, else
    Gemma 2's every other layer windowed, Gemma 3's ``sliding_window_pattern``: five in
    six). Refuses ``use_bidirectional_attention`` (EmbeddingGemma)."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention (EmbeddingGemma) is not "
                         "supported: tpserve's attention is causal")
    gemma1 = family == "GemmaForCausalLM"
    act = d.get("hidden_act") if gemma1 else d.get("hidden_activation")
    act = "gelu_pytorch_tanh" if act in (None, "gelu") else act  # transformers' legacy rule
    if act not in HIDDEN_ACTS:
        raise ValueError(f"config.json: hidden activation {act!r} is not supported "
                         f"(supported: {', '.join(HIDDEN_ACTS)})")
    n = d["num_hidden_layers"]
    fields: dict[str, Any] = dict(
        hidden_act=HIDDEN_ACTS[act], norm_unit_offset=True,
        embed_scale=float(d["hidden_size"]) ** 0.5,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        layer_types=d.get("layer_types"))
    if gemma1:
        return fields
    gemma2 = family == "Gemma2ForCausalLM"
    if fields["layer_types"] is None:
        every = 2 if gemma2 else int(d.get("sliding_window_pattern", 6))
        fields["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                 for i in range(n)]
    fields.update(
        sandwich_norms=True,
        attention_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=d.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        final_logit_softcap=d.get("final_logit_softcapping", 30.0 if gemma2 else None))
    if not gemma2:  # Gemma 3: q/k head norms, the windowed layers' own RoPE
        local = _gemma3_local_rope(d)
        full = (d.get("rope_parameters") or {}).get("full_attention") or {}
        fields.update(qk_norm=True, rope_theta=float(d.get("rope_theta",
                                                           full.get("rope_theta", 1e6))),
                      local_rope_theta=local[0], local_rope_scaling=local[1],
                      local_rope_layers=tuple(i for i, t in enumerate(fields["layer_types"])
                                              if t == "sliding_attention"))
    return fields


def _granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers, as transformers' Granite reads them (1 where absent):
    ``attention_multiplier`` is the attention scale itself."""
    return dict(embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(d.get("residual_multiplier", 1.0)),
                logits_scaling=float(d.get("logits_scaling", 1.0)),
                attention_scale=float(d.get("attention_multiplier", 1.0)))


def _gemma3_local_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Gemma 3's sliding-window layers' RoPE base and scaling: ``rope_parameters``'
    ``sliding_attention`` entry, else the older ``rope_local_base_freq`` (10,000 by
    default), unscaled."""
    params = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = params.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
    return float(theta), rope_scaling_from_hf(d, params)


def _token_classifier(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """vLLM's ``classifier_from_token`` overrides, checked as vLLM checks them: a
    ``*ForSequenceClassification`` architecture, a ``method`` (``is_original_qwen3_reranker``
    means ``from_2_way_softmax``), two tokens for ``from_2_way_softmax``."""
    tokens = d.get("classifier_from_token")
    if arch not in SEQUENCE_CLASSIFIERS:
        raise ValueError("classifier_from_token: the architecture must be a "
                         "*ForSequenceClassification one (--hf-overrides '{\"architectures\": "
                         f"[...]}}'), got {arch!r}")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) and t
                                                         for t in tokens)):
        raise ValueError(f"classifier_from_token must be a non-empty list of tokens, got "
                         f"{tokens!r}")
    method = d.get("method") or ("from_2_way_softmax" if d.get("is_original_qwen3_reranker")
                                 else None)
    if method is None:
        raise ValueError("classifier_from_token needs a method: from_2_way_softmax or "
                         "no_post_processing")
    if method not in TOKEN_CLASSIFIER_METHODS:
        raise ValueError(f"classifier_from_token: method {method!r} is not supported "
                         f"(supported: {', '.join(TOKEN_CLASSIFIER_METHODS)})")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"from_2_way_softmax needs two tokens (false, true), got {tokens!r}")
    if d.get("use_pad_token"):
        raise ValueError("use_pad_token is not supported: pairs are tokenized as the "
                         "tokenizer joins them")
    labels = (tokens[1],) if method == "from_2_way_softmax" else tuple(tokens)
    return dict(labels=labels, classifier_from_token=tuple(tokens), classifier_method=method)


def _labels(d: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's label names in id order, as transformers reads them: ``id2label``
    (ids as strings), else ``num_labels`` of ``LABEL_i`` (2 by default)."""
    id2label = d.get("id2label")
    if id2label:
        ids = sorted(int(i) for i in id2label)
        if ids != list(range(len(ids))):
            raise ValueError(f"config.json: id2label must number its labels 0..n-1, got "
                             f"{sorted(id2label)}")
        return tuple(str(id2label[str(i)] if str(i) in id2label else id2label[i])
                     for i in ids)
    return tuple(f"LABEL_{i}" for i in range(int(d.get("num_labels", 2))))


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
