"""GGUF checkpoints (llama.cpp's format): metadata and tensor table through our own
``gguf_reader`` (fast), dequantisation through the ``gguf`` package.

Tensors are dequantized lazily, shard by shard: a rank reads only its rows (or, for
row-parallel weights, its quantization-block-aligned columns).

The trap: llama.cpp stores the rows of each ``attn_q`` / ``attn_k`` head reordered for its
rotary layout (the two halves of the head interleaved). ``read`` undoes that per head
(``attn_k`` with the KV head count), which Hugging Face's layout and our RoPE expect.

RoPE scaling comes two ways. llama.cpp's converter writes Llama-3's as a tensor,
``rope_freqs.weight`` (per rotated pair, the divisor of its frequency), read here into the
config (``freq_factors``), never loaded as a weight; linear and YaRN scaling as
``{arch}.rope.scaling.*`` metadata, read into the ``RopeScaling`` transformers would compute
from the original ``config.json`` (through ``rope_scaling.build_rope_scaling``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tpserve.model.config import ModelConfig
from tpserve.model.loader import gguf_integer
from tpserve.model.loader.gguf_reader import GGUFFile
from tpserve.model.rope_scaling import RopeScaling, build_rope_scaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "granite": "GraniteForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
# a ``llama`` file with experts is Mixtral (its q/k rows permuted as a Llama's)
_LLAMA_EXPERTS = "MixtralForCausalLM"
# llama.cpp renormalizes the top-k weights of these (``{arch}.expert_weights_norm``
# where the file says)
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# llama.cpp's converter permutes these architectures' q/k rows (its LlamaModel's, which
# Granite's extends); ``iter_weights`` undoes it
_PERMUTED = ("LlamaForCausalLM", "GraniteForCausalLM", _LLAMA_EXPERTS)
# Granite's multipliers, as llama.cpp's converter writes them -> ModelConfig's fields
_GRANITE_SCALES = {"attention.scale": "attention_scale", "embedding_scale":
                   "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "logit_scale": "logits_scaling"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, every expert's part stacked ``[E, rows, cols]``
    # (``layers.moe.expert_param``), Qwen2-MoE's shared expert and its gate (``[H]``)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# llama.cpp's Phi-3 keeps Hugging Face's fused tensors: q/k/v rows in ``attn_qkv``, gate
# then up rows in ``ffn_up`` (loaded part by part: ``checkpoint_names.FUSED``)
# Gemma 2/3's four norms: ``ffn_norm`` is the MLP input's, ``post_attention_norm`` the
# attention output's
_SANDWICH_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {"phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                              "ffn_up": "mlp.gate_up_proj"},
                     "gemma2": _SANDWICH_NAMES, "gemma3": _SANDWICH_NAMES}
# llama.cpp's Gemma 2/3 at 27B scale attention by (hidden / heads) ** -0.5 (Hugging Face's
# query_pre_attn_scalar: 144 and 168), every other size by head_dim ** -0.5; the files carry
# no scale, llama.cpp tells the 27B models by their layer count
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
# LongRoPE's per-pair factors as tensors (Phi-3-*-128k, Phi-3.5, Phi-4-mini): not served
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# tensors that are config, not weights: read by ``read_config``, skipped by ``iter_weights``
_ROPE_FREQS = "rope_freqs.weight"
_CONFIG_TENSORS = {_ROPE_FREQS}
# ``{arch}.rope.scaling.type`` -> transformers' rope_type (None: plain RoPE)
_SCALING_TYPES = {"none": None, "linear": "linear", "yarn": "yarn"}


def open_reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (``arch``'s
    names: Phi-3's fused tensors keep their Hugging Face names)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if part not in names:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def read_config(r, path: Path) -> ModelConfig:
    """Model shape from the GGUF metadata of reader ``r``."""
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r} in {path.name}; supported GGUF "
                         f"architectures: {', '.join(sorted(ARCHITECTURES))}")
    names = {t.name for t in r.tensors}
    experts = _experts(r, arch, path)
    heads = int(_field(r, f"{arch}.attention.head_count"))
    hidden = int(_field(r, f"{arch}.embedding_length"))
    head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // heads))
    context = int(_field(r, f"{arch}.context_length", 4096))
    vocab = _field(r, f"{arch}.vocab_size") or len(r.fields["tokenizer.ggml.tokens"])
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    longrope = [n for n in _LONGROPE_TENSORS if n in names]
    if longrope:
        raise ValueError(f"{path.name}: LongRoPE factors as tensors ({', '.join(longrope)}; "
                         "Phi-3-*-128k, Phi-3.5, Phi-4-mini) are not supported in GGUF files: "
                         "serve the safetensors checkpoint")
    # Phi-3's partial_rotary_factor: the rotated dims of each head (others: the whole head)
    rotary_dim = _field(r, f"{arch}.rope.dimension_count") if arch == "phi3" else None
    layers = int(_field(r, f"{arch}.block_count"))
    window = _field(r, f"{arch}.attention.sliding_window") or None
    gemma = (_gemma_fields(r, arch, layers, hidden // heads, head_dim, window)
             if arch.startswith("gemma") else {})
    if arch == "granite":
        gemma = {ours: float(value) for key, ours in _GRANITE_SCALES.items()
                 if (value := _field(r, f"{arch}.{key}")) is not None}
    return ModelConfig(**{**dict(
        architecture=_LLAMA_EXPERTS if experts and arch == "llama" else ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(r, f"{arch}.feed_forward_length")
                              or experts["moe_intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        # llama.cpp writes bo for a Llama with attention_bias (Qwen2 has none to write)
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(r, arch, path, head_dim, context),
        rotary_dim=None if rotary_dim is None else int(rotary_dim),
        sliding_window=window,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    ), **gemma, **experts})


def _experts(r, arch: str, path: Path) -> dict:
    """A mixture of experts' config fields as llama.cpp reads them (every layer sparse;
    the top-k weights renormalized per ``_EXPERT_WEIGHTS_NORM``, or the file's
    ``expert_weights_norm``); ``{}`` for a dense model."""
    count = int(_field(r, f"{arch}.expert_count") or 0)
    if not count:
        return {}
    if arch not in _EXPERT_WEIGHTS_NORM:
        raise ValueError(f"{path.name}: a {arch} mixture of experts is not supported (GGUF "
                         f"experts: {', '.join(sorted(_EXPERT_WEIGHTS_NORM))})")
    width = _field(r, f"{arch}.expert_feed_forward_length",
                   _field(r, f"{arch}.feed_forward_length"))
    layers = int(_field(r, f"{arch}.block_count"))
    return dict(num_experts=count,
                num_experts_per_tok=int(_field(r, f"{arch}.expert_used_count", 0)),
                moe_intermediate_size=int(width),
                norm_topk_prob=bool(_field(r, f"{arch}.expert_weights_norm",
                                           _EXPERT_WEIGHTS_NORM[arch])),
                shared_expert_intermediate_size=int(
                    _field(r, f"{arch}.expert_shared_feed_forward_length", 0)),
                moe_layers=tuple(range(layers)))


def _gemma_fields(r, arch: str, layers: int, hidden_per_head: int, head_dim: int,
                  window: int | None) -> dict:
    """Gemma's config fields as llama.cpp reads them (see ``families.gemma_fields``): the
    softcaps from metadata; the windowed layers every other one from the first (Gemma 2)
    or five in six (Gemma 3; ``attention.sliding_window_pattern`` where the file has it);
    Gemma 3's windowed layers on RoPE base ``rope.freq_base_swa``, else 10,000 unscaled.
    The norm weights are stored as ``1 + w`` (``iter_weights`` undoes it)."""
    fields = dict(hidden_act="gelu_tanh", norm_unit_offset=True,
                  embed_scale=float(_field(r, f"{arch}.embedding_length")) ** 0.5)
    if arch == "gemma":
        return fields
    every = 2 if arch == "gemma2" else int(_field(r, f"{arch}.attention.sliding_window_pattern",
                                                  6))
    windowed = tuple(i for i in range(layers) if (i + 1) % every)
    big = layers == _GEMMA_27B_LAYERS[arch]
    fields.update(
        sandwich_norms=True,
        attention_scale=float(hidden_per_head if big else head_dim) ** -0.5,
        attn_logit_softcap=_field(r, f"{arch}.attn_logit_softcapping") or None,
        final_logit_softcap=_field(r, f"{arch}.final_logit_softcapping") or None,
        full_attention_layers=tuple(i for i in range(layers) if i not in windowed)
        if window is not None else ())
    if arch == "gemma3":
        fields.update(local_rope_theta=float(_field(r, f"{arch}.rope.freq_base_swa", 10000.0)),
                      local_rope_layers=windowed)
    return fields


def _rope_scaling(r, arch: str, path: Path, head_dim: int,
                  context: int) -> RopeScaling | None:
    """The file's RoPE scaling: its ``rope_freqs.weight`` (Llama-3's), or its
    ``{arch}.rope.scaling.*`` metadata, read as llama.cpp reads it (no type is ``linear``;
    no factor, or 0, is no scaling; ``rope.scale_linear`` is the factor's old name) into
    the scaling transformers computes from the original ``config.json``.

    YaRN's attention factor: llama.cpp's converter writes transformers' ``attention_factor``
    as ``yarn_attn_factor`` (Olmo2's path and some other writers as ``attn_factor``), taken
    as given; without either it is derived from the factor, as transformers derives it.
    ``yarn_log_multiplier`` is refused: converters write it for DeepSeek-style models only,
    some as ``mscale_all_dim`` and some as a tenth of it, so its meaning depends on the
    writer. Where transformers' and llama.cpp's readings differ
    (llama.cpp derives the factor whatever ``yarn_attn_factor`` says, and multiplies
    ``attn_factor`` on top) this follows transformers', the model's own numbers."""
    key = f"{arch}.rope.scaling."
    kind = _field(r, key + "type", "linear")
    if kind not in _SCALING_TYPES:
        raise ValueError(f"{path.name}: RoPE scaling type {kind!r} ({key}type) is not "
                         f"supported (supported: {', '.join(_SCALING_TYPES)})")
    factor = _field(r, key + "factor") or _field(r, f"{arch}.rope.scale_linear")
    rope_type = _SCALING_TYPES[kind] if factor else None
    attention = _field(r, key + "yarn_attn_factor", _field(r, key + "attn_factor"))
    if rope_type != "yarn" and attention not in (None, 1.0):
        raise ValueError(f"{path.name}: a RoPE attention factor of {attention} without YaRN "
                         "scaling is not supported")
    ext = _field(r, key + "yarn_ext_factor")
    if rope_type == "yarn" and ext not in (None, 1.0):
        raise ValueError(f"{path.name}: a YaRN extrapolation factor of {ext} "
                         f"({key}yarn_ext_factor) is not supported (only 1)")
    freqs = next((t for t in r.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        if rope_type is not None:
            raise ValueError(f"{path.name}: {_ROPE_FREQS} together with {kind} RoPE scaling "
                             "is not supported")
        factors = GGUFSource(freqs, None).read().flatten().tolist()
        if len(factors) != head_dim // 2:
            raise ValueError(f"{path.name}: {_ROPE_FREQS} holds {len(factors)} factors, not "
                             f"one per rotated pair of a {head_dim}-wide head "
                             f"({head_dim // 2})")
        if not all(0 < f < float("inf") for f in factors):
            raise ValueError(f"{path.name}: {_ROPE_FREQS} holds a factor that is not "
                             f"positive and finite: {min(factors)} .. {max(factors)}")
        return build_rope_scaling("freq_factors", {"freq_factors": factors}, context)
    if rope_type is None:
        return None
    if _field(r, key + "yarn_log_multiplier") is not None:
        raise ValueError(f"{path.name}: {key}yarn_log_multiplier is not supported (its scale "
                         "differs between converters)")
    return build_rope_scaling(rope_type, {
        "factor": factor,
        "original_max_position_embeddings": _field(r, key + "original_context_length"),
        "beta_fast": _field(r, key + "yarn_beta_fast"),
        "beta_slow": _field(r, key + "yarn_beta_slow"),
        "attention_factor": attention,
    }, context)


class GGUFSource:
    """One GGUF tensor in torch orientation ``[out, in]``, dequantized on ``read``."""

    def __init__(self, tensor, unpermute_heads: int | None, shift: float = 0.0):
        from gguf.constants import GGML_QUANT_SIZES

        self.shift = shift  # added to every value read (Gemma's norms: -1)
        self.data = tensor.data
        self.qtype = tensor.tensor_type
        self.shape = tuple(int(x) for x in reversed(tensor.shape))
        self.block_elems, self.block_bytes = GGML_QUANT_SIZES[self.qtype]
        self.unpermute_heads = unpermute_heads

    def _dequantize(self, data: np.ndarray) -> torch.Tensor:
        from gguf.quants import dequantize

        return torch.from_numpy(np.array(dequantize(data, self.qtype), dtype=np.float32))

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        data = self.data
        rows = self.shape[0]
        if dim is not None:
            length = self.shape[dim] - start if length is None else length
        if dim == 0:
            data = data[start:start + length]
            rows = length
        col_slice = None
        if dim == 1:
            be = self.block_elems
            if be == 1:
                data = data[:, start:start + length]
            elif start % be == 0 and length % be == 0:
                nb = self.block_bytes
                data = data[:, start // be * nb:(start + length) // be * nb]
            else:
                col_slice = (start, length)
        out = self._dequantize(data)
        if len(self.shape) > 2:  # experts stacked: read whole experts (dim 0) only
            if dim not in (None, 0):
                raise ValueError(f"a {len(self.shape)}-d GGUF tensor is read along dim 0")
            out = out.reshape(rows, *self.shape[1:])
        elif len(self.shape) > 1:
            out = out.reshape(rows, -1)
        if col_slice is not None:
            out = out[:, col_slice[0]:col_slice[0] + col_slice[1]]
        if self.unpermute_heads is not None:
            out = self._unpermute(out, start if dim == 0 else 0)
        return out + self.shift if self.shift else out

    def _unpermute(self, w: torch.Tensor, row_start: int) -> torch.Tensor:
        """Undo llama.cpp's per-head row interleaving for the heads in ``w``."""
        return gguf_integer.unpermute_rows(w, self.unpermute_heads, self.shape[0], row_start)


def num_weights(r, integer: bool = False) -> int:
    """How many tensors ``iter_weights`` yields (the file's, less its config tensors; with
    ``integer``, three for each linear weight served as stored)."""
    count = sum(t.name not in _CONFIG_TENSORS for t in r.tensors)
    if integer:
        count += 2 * sum(bool(gguf_integer.LINEAR.fullmatch(t.name)) for t in r.tensors)
    return count


def iter_weights(r, cfg: ModelConfig, integer: bool = False
                 ) -> Iterator[tuple[str, GGUFSource | gguf_integer.GGUFBlocks]]:
    """The file's weights by Hugging Face name; a Gemma file's norms (stored ``1 + w`` by
    llama.cpp's converter) read as ``w``, what the model's unit-offset norms take. With
    ``integer`` (``--quantization gguf``), each decoder linear weight as its codes, scales
    and zero points (``gguf_integer``: ``q_proj.gguf_codes`` ...) instead of floats."""
    permute = cfg.architecture in _PERMUTED
    arch = _field(r, "general.architecture")
    forms = gguf_integer.module_forms(r.tensors) if integer else None
    if integer and forms is None:
        raise ValueError("the GGUF file's decoder linear weights are not all of types "
                         "served as stored (loader/gguf_blocks.py)")
    for t in r.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        heads = None
        if permute and ".attn_q." in t.name:
            heads = cfg.num_attention_heads
        elif permute and ".attn_k." in t.name:
            heads = cfg.num_key_value_heads
        name = hf_name(t.name, arch)
        linear = gguf_integer.LINEAR.fullmatch(t.name) if integer else None
        if linear is not None:
            base = name.removesuffix(".weight")
            form = forms[(int(linear[1]), gguf_integer.MODULES[linear[2]])]
            for part, suffix in zip(("codes", "scales", "zeros"), gguf_integer.SUFFIXES,
                                    strict=True):
                yield f"{base}.{suffix}", gguf_integer.GGUFBlocks(t, part, heads, form)
            continue
        shift = -1.0 if cfg.norm_unit_offset and t.name.endswith("norm.weight") else 0.0
        yield name, GGUFSource(t, heads, shift)


