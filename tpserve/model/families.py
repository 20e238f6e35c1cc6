"""What each architecture family changes in a ``config.json``'s reading, beside Llama's
(``ModelConfig.from_hf`` applies it): base models, multimodal checkpoints' language models
and sequence classifiers mapped onto their causal LM (``architecture_family``); Gemma's
and SmolLM3's files completed by transformers' own config class; Gemma's, Granite's, a
classifier's and a mixture of experts' ``ModelConfig`` fields."""

from __future__ import annotations

from typing import Any

from tpserve.model.rope_scaling import RopeScaling, rope_scaling_from_hf

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
# mixture-of-experts models -> the dense family whose attention (and flags) they share;
# their experts: ``moe_fields``
MOE_ARCHITECTURES = {"MixtralForCausalLM": "MistralForCausalLM",
                     "GraniteMoeForCausalLM": "GraniteForCausalLM",
                     "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
                     "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}
# config.json's activation names -> the MLP gates the model runs (gated: act(gate) * up)
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def architecture_family(arch: str) -> str:
    """The causal LM whose flags ``arch`` takes: a base model's (``BASE_ARCHITECTURES``),
    a multimodal checkpoint's language model (``LANGUAGE_MODEL_OF``), a sequence
    classifier's decoder (``SEQUENCE_CLASSIFIERS``) or a mixture of experts' dense family
    (``MOE_ARCHITECTURES``), else itself."""
    return (BASE_ARCHITECTURES.get(arch) or LANGUAGE_MODEL_OF.get(arch)
            or SEQUENCE_CLASSIFIERS.get(arch) or MOE_ARCHITECTURES.get(arch) or arch)


def moe_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """A mixture of experts' ``ModelConfig`` fields, as transformers builds the model:
    Mixtral's and Granite-MoE's every layer sparse, their experts ``intermediate_size``
    wide, the top-k weights renormalized (Granite-MoE's softmax over the top-k logits is
    that); Qwen2-MoE's and Qwen3-MoE's sparse layers every ``decoder_sparse_step`` but
    ``mlp_only_layers`` (the rest dense, ``intermediate_size`` wide), experts ``moe_intermediate_size`` wide, renormalized by ``norm_topk_prob``,
    Qwen2-MoE's shared expert gated by a sigmoid. ``{}`` without experts."""
    experts = int(d.get("num_experts", d.get("num_local_experts")) or 0)
    if not experts:
        return {}
    top_k = int(d.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"config.json: num_experts_per_tok must be from 1 to the "
                         f"{experts} experts, got {top_k}")
    layers = int(d["num_hidden_layers"])
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=tuple(range(layers)))
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or ())
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=shared if arch == "Qwen2MoeForCausalLM" else 0,
                moe_layers=tuple(i for i in range(layers)
                                 if i not in dense and (i + 1) % step == 0))


def completed_config(d: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
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


def gemma_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
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
        local = gemma3_local_rope(d)
        full = (d.get("rope_parameters") or {}).get("full_attention") or {}
        fields.update(qk_norm=True, rope_theta=float(d.get("rope_theta",
                                                           full.get("rope_theta", 1e6))),
                      local_rope_theta=local[0], local_rope_scaling=local[1],
                      local_rope_layers=tuple(i for i, t in enumerate(fields["layer_types"])
                                              if t == "sliding_attention"))
    return fields


def granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers, as transformers' Granite reads them (1 where absent):
    ``attention_multiplier`` is the attention scale itself."""
    return dict(embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(d.get("residual_multiplier", 1.0)),
                logits_scaling=float(d.get("logits_scaling", 1.0)),
                attention_scale=float(d.get("attention_multiplier", 1.0)))


def gemma3_local_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Gemma 3's sliding-window layers' RoPE base and scaling: ``rope_parameters``'
    ``sliding_attention`` entry, else the older ``rope_local_base_freq`` (10,000 by
    default), unscaled."""
    params = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = params.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
    return float(theta), rope_scaling_from_hf(d, params)


def token_classifier(d: dict[str, Any], arch: str) -> dict[str, Any]:
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


def classifier_labels(d: dict[str, Any]) -> tuple[str, ...]:
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




# transformers' ``problem_type`` of a sequence classifier (config.json, as its Trainer
# writes it): how /classify turns the logits into scores (``PoolerConfig.activation``)
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def classifier_problem_type(d: dict[str, Any]) -> str | None:
    """A classifier's ``problem_type`` (None when not given); another value is refused,
    as transformers refuses it."""
    kind = d.get("problem_type")
    if kind is not None and kind not in PROBLEM_TYPES:
        raise ValueError(f"config.json: problem_type must be one of {', '.join(PROBLEM_TYPES)}, "
                         f"got {kind!r}")
    return kind
