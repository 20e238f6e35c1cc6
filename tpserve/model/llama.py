"""The Llama-family decoder (Llama, Mistral, Qwen2) on tensor-parallel layers.

Parameter names are Hugging Face's, except the fused ``qkv_proj`` and ``gate_up_proj``,
which ``STACKED`` maps checkpoint names onto.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.config import ModelConfig
from tpserve.model.kernels.backend import Ops
from tpserve.model.layers.norm import RMSNorm
from tpserve.model.layers.rotary import cos_sin_cache
from tpserve.parallel.comm import Communicator
from tpserve.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.parallel.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.parallel.shard import TensorSource, as_source, copy_into

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint name fragment -> (fused parameter fragment, shard id)
STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, attn: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        self.attn = attn
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, comm, cfg.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        comm, cfg.o_bias, dtype)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor,
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.attn.rope_and_write_kv(q, k, v, positions, rope, kv[0], kv[1], meta)
        out = self.attn.forward(q, kv[0], kv[1], meta, self.scale)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, dtype: torch.dtype):
        super().__init__()
        self.ops = ops
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], comm,
                                                       dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, comm, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, comm, attn, dtype)
        self.mlp = LlamaMLP(cfg, comm, ops, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)

    def forward(self, x, residual, positions, rope, kv, meta):
        """Pre-norm block; the residual stream is carried separately so the add fuses."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, kv, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, comm, ops, attn, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states of every new token; ``compute_logits``
    turns the selected ones into full-vocabulary logits (on every rank)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.attn_backend = attn
        self.model = LlamaModel(cfg, comm, ops, attn, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "rope_cache",
            cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
            persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope_cache, kv, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> set[str]:
        """Loads checkpoint tensors by Hugging Face name; returns the parameter names loaded.

        Names the model does not have (rotary tables, a tied ``lm_head``) are skipped.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, source in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            shard_id = None
            for frag, (fused, sid) in STACKED.items():
                if frag in name:
                    name, shard_id = name.replace(frag, fused), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                copy_into(param, as_source(source).read(), name)
            else:
                loader(param, source, shard_id)
            loaded.add(name)
        return loaded
