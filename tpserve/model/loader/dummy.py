"""Dummy random weights of real model shapes (no files needed), for benchmarks."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from tpserve.model.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES = ("llama3-8b", "llama3-70b", "smollm2-135m", "qwen3-0.6b", "qwen3-8b", "phi-4",
          "phi-3-mini", "mistral-7b", "gemma-2-9b", "gemma-3-12b", "qwen3-30b-a3b",
          "mixtral-8x7b")
# architectures whose checkpoints store q/k/v and gate/up fused (``checkpoint_names.FUSED``)
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


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
    elif name == "phi-4":  # microsoft/phi-4's config.json (Phi-3's architecture)
        base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "rms_norm_eps": 1e-5}
        d = dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920,
                 num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                 rope_theta=250000.0, max_position_embeddings=16384,
                 original_max_position_embeddings=16384, sliding_window=None,
                 bos_token_id=100257, eos_token_id=100265)
    elif name == "phi-3-mini":  # microsoft/Phi-3-mini-4k-instruct: heads of 96, a window
        base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "rms_norm_eps": 1e-5}
        d = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 rope_theta=10000.0, max_position_embeddings=4096,
                 original_max_position_embeddings=4096, sliding_window=2047,
                 bos_token_id=1, eos_token_id=32000)
    elif name == "mistral-7b":  # mistralai/Mistral-7B-v0.1: a 4,096-token window
        base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "rms_norm_eps": 1e-5}
        d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096,
                 bos_token_id=1, eos_token_id=2)
    elif name == "gemma-2-9b":  # google/gemma-2-9b: softcaps, every other layer windowed
        base = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "rms_norm_eps": 1e-6}
        d = dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                 num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 max_position_embeddings=8192, bos_token_id=2, eos_token_id=1)
    elif name == "gemma-3-12b":  # google/gemma-3-12b-it's language model (text_config)
        base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "rms_norm_eps": 1e-6}
        d = dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                 rope_scaling={"rope_type": "linear", "factor": 8.0},
                 max_position_embeddings=131072, bos_token_id=2, eos_token_id=[1, 106])
    elif name == "qwen3-30b-a3b":  # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token
        base = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "rms_norm_eps": 1e-6}
        d = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 rope_theta=1000000.0, max_position_embeddings=40960, bos_token_id=151643,
                 eos_token_id=151645)
    elif name == "mixtral-8x7b":  # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token
        base = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "rms_norm_eps": 1e-5}
        d = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0,
                 max_position_embeddings=32768, sliding_window=None, bos_token_id=1,
                 eos_token_id=2)
    elif name.startswith("qwen3-"):
        base = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "rms_norm_eps": 1e-6}
        d = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, rope_theta=1000000.0,
                 max_position_embeddings=40960, eos_token_id=151645)
        if name == "qwen3-0.6b":
            d.update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, tie_word_embeddings=True)
        elif name == "qwen3-8b":
            d.update(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32)
        else:
            raise ValueError(f"unknown dummy shape {name!r}; choose one of {', '.join(SHAPES)}")
    else:
        raise ValueError(f"unknown dummy shape {name!r}; choose one of {', '.join(SHAPES)}")
    return {**base, **d}


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a Hugging Face checkpoint of this Llama-family config holds, by name;
    Phi-3's q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``), as its checkpoints
    store them, so that dummy weights load through the fused path."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
        if cfg.sandwich_norms:
            out += [(p + "pre_feedforward_layernorm.weight", (h,)),
                    (p + "post_feedforward_layernorm.weight", (h,))]
        fused = cfg.architecture in _FUSED_ARCHITECTURES
        out += ([(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h))] if fused else
                [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                 (p + "self_attn.v_proj.weight", (kv, h))])
        out.append((p + "self_attn.o_proj.weight", (h, q)))
        if cfg.is_moe_layer(i):
            out += _moe_tensors(cfg, p)
        else:
            out += ([(p + "mlp.gate_up_proj.weight", (2 * inter, h))] if fused else
                    [(p + "mlp.gate_proj.weight", (inter, h)),
                     (p + "mlp.up_proj.weight", (inter, h))])
            out.append((p + "mlp.down_proj.weight", (h, inter)))
        if cfg.qkv_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
        if cfg.o_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        if cfg.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, h)))
    return out


def _moe_tensors(cfg: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A mixture-of-experts layer's tensors as its checkpoints name them: Mixtral's
    ``block_sparse_moe`` (experts' ``w1`` gate, ``w3`` up, ``w2`` down), Qwen's ``mlp``
    (and Qwen2-MoE's shared expert)."""
    h, width, shared = (cfg.hidden_size, cfg.moe_intermediate_size,
                        cfg.shared_expert_intermediate_size)
    mixtral = cfg.architecture == "MixtralForCausalLM"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = [(block + "gate.weight", (cfg.num_experts, h))]
    for e in range(cfg.num_experts):
        out += [(f"{block}experts.{e}.{gate}.weight", (width, h)),
                (f"{block}experts.{e}.{up}.weight", (width, h)),
                (f"{block}experts.{e}.{down}.weight", (h, width))]
    if shared:
        out += [(block + "shared_expert.gate_proj.weight", (shared, h)),
                (block + "shared_expert.up_proj.weight", (shared, h)),
                (block + "shared_expert.down_proj.weight", (h, shared)),
                (block + "shared_expert_gate.weight", (1, h))]
    return out


_MASK32 = 0xFFFFFFFF
_HALF_WIDTH = 0.02 * 3 ** 0.5  # uniform on [-a, a] has std a / sqrt(3) = 0.02
_CHUNK = 1 << 24  # elements hashed at a time (bounds the temporaries)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (two multiply-xorshift rounds) on int64 values < 2**32."""
    for mult in (0x7FEB352D, 0x846CA68B):
        x = (x ^ (x >> 16)) * mult & _MASK32
    return x ^ (x >> 15)


class HashedSource:
    """A dummy tensor whose every element is a pure function of (seed, name, index):
    ``norm_value`` for norm weights (1, or 0 for Gemma's ``1 + w`` norms: a scale of 1
    either way), else uniform noise of std 0.02. ``read`` computes only the
    requested slice, on ``device``, so every tensor-parallel rank gets exactly its shard
    of the same full tensor (dummy weights do not change with ``--tensor-parallel-size``)
    and no full copy is ever made."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int, device: torch.device,
                 norm_value: float = 1.0):
        self.shape = shape
        self.norm = name.endswith("norm.weight")
        self.norm_value = norm_value
        self.key = zlib.crc32(f"{seed}:{name}".encode())
        self.device = device
        if math.prod(shape) > _MASK32:
            raise ValueError(f"{name}: {math.prod(shape)} elements exceed 32-bit indices")

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        shape = list(self.shape)
        if dim is None:
            dim, start, length = 0, 0, shape[0]
        length = shape[dim] - start if length is None else length
        out_shape = shape.copy()
        out_shape[dim] = length
        if self.norm:
            return torch.full(out_shape, self.norm_value, device=self.device)
        # rows and columns of the slice in the full tensor viewed as 2-D; hashed a block
        # of rows at a time so that no temporary grows with the tensor
        rows_full, cols_full = (1, shape[0]) if len(shape) == 1 else shape
        row0, col0 = 0, 0
        rows, cols = (1, length) if len(shape) == 1 else out_shape
        if len(shape) == 1:
            col0 = start
        elif dim == 0:
            row0 = start
        else:
            col0 = start
        out = torch.empty((rows, cols), dtype=torch.float32, device=self.device)
        col_index = torch.arange(col0, col0 + cols, dtype=torch.int64, device=self.device)
        step = max(1, _CHUNK // max(cols, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            row_index = torch.arange(row0 + r, row0 + r + n, dtype=torch.int64,
                                     device=self.device)
            h = _hash32((row_index[:, None] * cols_full + col_index[None, :]) ^ self.key)
            out[r:r + n] = (h.to(torch.float32) * (2.0 / _MASK32) - 1.0) * _HALF_WIDTH
        return out.view(out_shape)


def iter_weights(cfg: ModelConfig, seed: int, device: torch.device
                 ) -> Iterator[tuple[str, HashedSource]]:
    norm_value = 0.0 if cfg.norm_unit_offset else 1.0
    for name, shape in hf_tensors(cfg):
        yield name, HashedSource(name, shape, seed, device, norm_value)
