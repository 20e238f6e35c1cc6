"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1/2/3, Granite,
SmolLM3) on tensor-parallel layers.

Parameter names are Hugging Face's, except the fused ``qkv_proj`` and ``gate_up_proj``,
which ``checkpoint_names.STACKED`` maps checkpoint names onto. Phi-3 checkpoints store
those two fused (``FUSED``: q, k, v rows stacked; gate, then up): each part is loaded as if
stored apart (``ColumnParallelLinear.load_stacked``). Otherwise Phi-3 is Llama: pre-norm
RMSNorm blocks, SiLU-gated MLP, no biases; its ``partial_rotary_factor`` and ``longrope``
are the config's (``ModelConfig.rotary_dim``, ``rope_scaling.RopeScaling``). A sliding
window (Mistral, Phi-3, Qwen's ``use_sliding_window`` layers) is each attention layer's
own (``ModelConfig.window_of``), handed to the back-end's attention.

Gemma is Llama with what its ``ModelConfig`` fields say: norms scaling by ``1 + w``
(``norm_unit_offset``), a GeLU-tanh gate, the embedding times sqrt(hidden); Gemma 2/3 add
a norm after attention and after the MLP (``sandwich_norms``: their checkpoint's
``post_attention_layernorm`` is the attention output's norm, ``pre_feedforward_layernorm``
the MLP input's), ``query_pre_attn_scalar``'s attention scale, softcapped attention and
final logits (Gemma 2), q/k head norms and the windowed layers' own RoPE table (Gemma 3).
Granite is Llama with multipliers: the embedding's output, each attention and MLP output
before its residual add, the attention scale, and a divisor of the logits. SmolLM3's NoPE
layers rotate by an identity table (cos 1, sin 0: one row, every position reading it).

``tp_comm`` (see ``parallel/comm.py``): with "allreduce" every rank holds all T tokens
between layers. With "allgather" (sequence parallel) the step is padded to T' tokens, a
multiple of tp, and rank r holds tokens ``[r*T'/tp, (r+1)*T'/tp)`` of the residual
stream: the embedding and every row-parallel layer end in a reduce-scatter over tokens,
each RMSNorm runs on the local tokens, an all-gather feeds the column-parallel layers
(qkv, gate_up), and the final hidden states are all-gathered before the LM head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.checkpoint_names import (
    FUSED,
    is_zero,
    load_kv_scale,
    model_name,
    stacked_name,
    stacked_parts,
)
from tpserve.model.config import ModelConfig
from tpserve.model.families import LANGUAGE_MODEL_OF
from tpserve.model.kernels.backend import Ops
from tpserve.model.kernels.torch_ops import HeadNorm
from tpserve.model.kv_cache_dtype import KV_SCALE_NAMES
from tpserve.model.layers.moe import ExpertLoading, SparseMoeBlock
from tpserve.model.layers.norm import RMSNorm
from tpserve.model.layers.rotary import cos_sin_cache
from tpserve.model.quant.fp8 import Fp8Activation
from tpserve.model.quant.methods import module_method
from tpserve.parallel.comm import TP_COMM_MODES, Communicator
from tpserve.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.parallel.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    input_quantization,
)
from tpserve.parallel.shard import ShardMap, TensorSource, as_source, copy_into

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention on this rank's heads. With ``cfg.qk_norm`` (Qwen3) each query and
    key head is RMS-normed over ``head_dim`` before RoPE, inside the back-end's RoPE + KV
    write (``q_norm``/``k_norm`` hold the weights; a zero padding head stays zero)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype, reduce: str, quant=None, window: int | None = None,
                 layer: int = 0):
        super().__init__()
        self.attn = attn
        self.window = window  # this layer's sliding window (ModelConfig.window_of), or None
        self.qk_norm = cfg.qk_norm
        self.softcap = cfg.attn_logit_softcap
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype,
                                  cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype,
                                  cfg.norm_unit_offset)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, comm, cfg.qkv_bias, dtype,
                                          quant_method=module_method(quant, layer, "qkv_proj"))
        # o_proj's input columns follow the (padded) query heads of this rank
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        comm, cfg.o_bias, dtype,
                                        in_map=self.qkv_proj.layout.q_map(comm.rank,
                                                                          cfg.head_dim),
                                        reduce=reduce,
                                        quant_method=module_method(quant, layer, "o_proj"))
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        # the FP8 KV cache's scales, [K, V] (model/kv_cache_dtype.py): 1.0 unless the
        # checkpoint has them; fixed after load; ignored by other cache dtypes
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor,
                kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        head_norm = (HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                              self.q_norm.unit_offset) if self.qk_norm else None)
        q = self.attn.rope_and_write_kv(q, k, v, positions, rope, kv[0], kv[1], meta,
                                        self.kv_scale, head_norm)
        out = self.attn.forward(q, kv[0], kv[1], meta, self.scale, self.kv_scale, self.window,
                                self.softcap)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    """The gated MLP, ``intermediate`` columns wide (default: the config's); ``reduce``:
    its down projection's (``"none"``: partial sums, a MoE block's shared expert)."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, dtype: torch.dtype,
                 reduce: str, quant=None, intermediate: int | None = None, layer: int = 0):
        super().__init__()
        self.ops = ops
        self.gelu_tanh = cfg.hidden_act == "gelu_tanh"
        inter = intermediate or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], comm,
                                                       dtype=dtype,
                                                       quant_method=module_method(
                                                           quant, layer, "gate_up_proj"))
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, comm, dtype=dtype,
            in_map=ShardMap.contiguous(inter, comm.world_size, comm.rank), reduce=reduce,
            quant_method=module_method(quant, layer, "down_proj"))

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if self.gelu_tanh:  # Gemma: no fused variants (down_proj quantizes its own input)
            return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))
        how = input_quantization(self.down_proj, x.shape[0])
        if how is not None:  # the gate quantizes too
            q = self.ops.silu_and_mul_fp8(self.gate_up_proj(x), *how)
            return self.down_proj(Fp8Activation(*q))
        return self.down_proj(self.gate_up_proj.forward_silu_mul(x, self.ops.silu_and_mul))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype, sequence_parallel: bool, quant=None, layer: int = 0,
                 expert_parallel: bool = False):
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
        # ``quant``: one method for every module, or a method per module (ModuleMethods)
        self.self_attn = LlamaAttention(cfg, comm, ops, attn, dtype, reduce, quant,
                                        cfg.window_of(layer), layer)
        self.mlp = (_moe_block(cfg, comm, ops, dtype, reduce, quant, expert_parallel)
                    if cfg.is_moe_layer(layer)
                    else LlamaMLP(cfg, comm, ops, dtype, reduce, quant, layer=layer))
        self.local_rope = cfg.uses_local_rope(layer)  # the model hands it the local table
        self.nope = layer in cfg.nope_layers  # ... or the identity table
        self.sandwich = cfg.sandwich_norms
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1: none
        # Gemma's norms (unit offset) never quantize their output: ``fuse`` is off (nor do a
        # mixture of experts': its experts take their input unquantized)
        self.fuse_quant = not (sequence_parallel or cfg.norm_unit_offset or cfg.num_experts)

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, cfg.norm_unit_offset)
        self.input_layernorm = norm()
        # with sandwich norms (Gemma 2/3) the attention output's norm; else the MLP input's
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, positions, rope, kv, meta):
        """Pre-norm block; the residual stream is carried separately so the add fuses.
        Sequence parallel: ``x`` and ``residual`` are this rank's tokens; the normed tokens
        are all-gathered before each column-parallel layer. Otherwise, where qkv or gate/up
        take fp8 input at this step's size, the norm quantizes its output (per token, with
        the layer's static input scale, or per group of a block-wise layer's columns)."""
        m = x.shape[0]
        fuse = self.fuse_quant
        qkv, gate_up = self.self_attn.qkv_proj, getattr(self.mlp, "gate_up_proj", None)
        how = input_quantization(qkv, m) if fuse else None
        if residual is None:
            residual = x
            h = self.input_layernorm(x, quantize=how)
        else:
            h, residual = self.input_layernorm(x, residual, quantize=how)
        if self.sequence_parallel:
            h = self.comm.all_gather(h, dim=0)
        h = self.self_attn(h, positions, rope, kv, meta)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h),
                                                         residual)
        else:
            h, residual = self.post_attention_layernorm(
                h, residual, quantize=input_quantization(gate_up, m) if fuse else None)
        if self.sequence_parallel:
            h = self.comm.all_gather(h, dim=0)
        h = self.mlp(h)
        if self.sandwich:
            h = self.post_feedforward_layernorm(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        return h, residual


def _moe_block(cfg: ModelConfig, comm: Communicator, ops: Ops, dtype: torch.dtype,
               reduce: str, quant=None, expert_parallel: bool = False) -> SparseMoeBlock:
    shared = (LlamaMLP(cfg, comm, ops, dtype, "none", quant,
                       intermediate=cfg.shared_expert_intermediate_size)
              if cfg.shared_expert_intermediate_size else None)
    return SparseMoeBlock(cfg, comm, ops, dtype, reduce, shared, quant, expert_parallel)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype, sequence_parallel: bool, quant=None,
                 expert_parallel: bool = False, layers_device: torch.device | None = None):
        """``layers_device``: where the decoder layers are built (default: the current
        device); ``--cpu-offload-gb`` builds them in host memory
        (``weight_offload.place_layers`` moves them)."""
        super().__init__()
        reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm, dtype,
                                                   reduce=reduce)
        with torch.device(layers_device or torch.get_default_device()):
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(cfg, comm, ops, attn, dtype, sequence_parallel, quant, i,
                                  expert_parallel)
                for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype,
                            cfg.norm_unit_offset)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states of every new token (all T rows, on every
    rank, in either ``tp_comm`` mode); ``compute_logits`` turns the selected ones into
    full-vocabulary logits (on every rank).

    ``quant_method`` (``model/quant``; None: unquantized) is every q/k/v, o, gate/up and
    down projection's, and a mixture of experts' experts' (``process_experts``); the
    embedding, the LM head and a router stay in ``dtype``."""

    def __init__(self, cfg: ModelConfig, comm: Communicator, ops: Ops, attn: AttentionBackend,
                 dtype: torch.dtype, max_positions: int, tp_comm: str = "allreduce",
                 quant_method=None, lm_head: bool = True, expert_parallel: bool = False,
                 layers_device: torch.device | None = None):
        super().__init__()
        if tp_comm not in TP_COMM_MODES:
            raise ValueError(f"unknown tp_comm {tp_comm!r}; choose one of {TP_COMM_MODES}")
        if cfg.num_experts and not getattr(quant_method, "quantizes_experts", True):
            raise ValueError(f"{cfg.architecture} is a mixture of experts: the experts of "
                             "an FP8, GPTQ or AWQ checkpoint (or of a GGUF file held as "
                             "stored, --quantization gguf) are not supported yet; serve the "
                             "model's unquantized checkpoint or the GGUF file dequantized "
                             "(--quantization auto; fp8 quantizes either at load)")
        self.cfg = cfg
        self.comm = comm
        self.attn_backend = attn
        self.sequence_parallel = tp_comm == "allgather" and comm.world_size > 1
        if expert_parallel and not cfg.num_experts:
            raise ValueError(f"--enable-expert-parallel: {cfg.architecture} has no experts")
        self.model = LlamaModel(cfg, comm, ops, attn, dtype, self.sequence_parallel,
                                quant_method, expert_parallel, layers_device)
        # --cpu-offload-gb: the last layers' weights streamed from host memory
        # (``weight_offload.LayerWeightStream``, set by ``build_model``); None: all resident
        self.weight_stream = None
        # a pooling runner's model has no LM head (``lm_head=False``): none is allocated,
        # loaded or required of the checkpoint, and ``compute_logits`` refuses
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm, dtype)
                        if lm_head else None)
        if cfg.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a sequence classifier's head (``cfg.labels``; Hugging Face's ``score.weight``),
        # whole on every rank; rank 0's engine applies it to pooled rows
        # (``pooling.classifier_head``, ``pooling.finish_classification``)
        self.score = None
        # vLLM's ``classifier_from_token``: the label tokens' ids (set by the loader before
        # ``load_weights``), whose LM head rows become ``score``
        self.classifier_token_ids: tuple[int, ...] = ()
        if cfg.labels:
            self.score = nn.Linear(cfg.hidden_size, len(cfg.labels), bias=False, dtype=dtype)
            self.score.weight.requires_grad_(False)
        # set by load_weights when the checkpoint carries any KV cache scale
        self.kv_scales_from_checkpoint = False
        attn.check_model(cfg.head_dim, cfg.rotary_dim, cfg.qk_norm)
        # over the rotated dims only: the back-ends pass the rest of each head through
        self.register_buffer(
            "rope_cache",
            cos_sin_cache(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
            persistent=False)
        # Gemma 3's windowed layers' own table (None where every layer takes the one above)
        self.register_buffer(
            "local_rope_cache",
            cos_sin_cache(cfg.rotary_dim, max_positions, cfg.local_rope_theta,
                          cfg.local_rope_scaling) if cfg.local_rope_layers else None,
            persistent=False)
        # SmolLM3's NoPE layers' table: cos 1 and sin 0 (exact identity), one row expanded
        # over every position (stride 0: no memory per position)
        self.register_buffer(
            "identity_rope_row",
            torch.cat([torch.ones(cfg.rotary_dim // 2), torch.zeros(cfg.rotary_dim // 2)])[None]
            if cfg.nope_layers else None, persistent=False)
        # Gemma: the embedding's output times sqrt(hidden), the factor rounded to ``dtype``
        # as transformers rounds it
        # (Granite's multiplier is applied as given)
        self.embed_scale = (torch.tensor(cfg.embed_scale, dtype=dtype).item()
                            if cfg.embed_scale is not None
                            else cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0
                            else None)
        self.final_logit_softcap = cfg.final_logit_softcap
        self.logits_scaling = cfg.logits_scaling  # Granite's divisor; 1: none

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        if self.sequence_parallel:
            input_ids, positions, meta = self._pad_to_ranks(input_ids, positions, meta)
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = None
        stream = self.weight_stream
        if stream is not None:
            stream.start()
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            rope = self.local_rope_cache if layer.local_rope else self.rope_cache
            if layer.nope:
                rope = self.identity_rope_row.expand(self.rope_cache.shape[0], -1)
            if stream is not None:
                stream.before(i)
            x, residual = layer(x, residual, positions, rope, kv, meta)
            if stream is not None:
                stream.after(i)
        if stream is not None:
            stream.finish()
        x, _ = self.model.norm(x, residual)
        if self.sequence_parallel:
            x = self.comm.all_gather(x, dim=0)[:num_tokens]
        return x

    def _pad_to_ranks(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pads the step with dummy tokens up to a multiple of tp: token 0, position 0,
        slot -1 (never written to the KV cache). No sequence owns them (the metadata's
        ``query_start_loc`` ends before them), so attention leaves their rows alone; every
        other op is row-wise, so they never touch a real token, and ``forward`` drops them
        after the final all-gather."""
        pad = -input_ids.shape[0] % self.comm.world_size
        if pad == 0:
            return input_ids, positions, meta
        return (F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)),
                replace(meta, slot_mapping=F.pad(meta.slot_mapping, (0, pad), value=-1)))

    def _label_rows(self, name: str, source: TensorSource) -> bool:
        """A classifier by tokens (``cfg.classifier_from_token``): when ``name`` is the LM
        head's tensor (the embedding's, tied), its label tokens' rows into ``score`` (as
        ``cfg.classifier_method`` combines them); whether it did."""
        cfg = self.cfg
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if not cfg.classifier_from_token or name != head:
            return False
        if len(self.classifier_token_ids) != len(cfg.classifier_from_token):
            raise RuntimeError("the loader sets classifier_token_ids before load_weights")
        src = as_source(source)
        rows = torch.stack([src.read(0, i, 1)[0].float() for i in self.classifier_token_ids])
        if cfg.classifier_method == "from_2_way_softmax":
            rows = rows[1:] - rows[:1]  # true less false: sigmoid = the 2-way softmax's true
        with torch.no_grad():
            self.score.weight.copy_(rows.to(self.score.weight.dtype))
        return True

    def kv_scales(self) -> torch.Tensor:
        """Every layer's FP8 KV cache scales, ``[num_layers, 2]`` (K, V), a copy."""
        return torch.stack([layer.self_attn.kv_scale for layer in self.model.layers])

    def set_kv_scales(self, scales: torch.Tensor) -> None:
        """``kv_scales()``'s ``[num_layers, 2]`` copied back into the layers' buffers (their
        addresses kept: the CUDA graphs read them)."""
        for layer, row in zip(self.model.layers, scales, strict=True):
            layer.self_attn.kv_scale.copy_(row)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("this model was built without an LM head (--runner pooling)")
        logits = self.lm_head(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, TensorSource]]) -> set[str]:
        """Loads checkpoint tensors by Hugging Face name; returns the names loaded: the
        parameters, and each part of a fused one (``checkpoint_names.STACKED``: q/k/v,
        gate/up) by its name before fusing. A fused parameter counts as loaded only once
        every part has (``checkpoint_names.stacked_parts``; its rows are uninitialised
        memory until then), so a caller can name the parts a checkpoint lacks.

        Names the model does not have (rotary tables, a tied ``lm_head``, any ``lm_head``
        without a head) are skipped; other names are mapped by ``checkpoint_names``: a base
        model's names are the ``model.`` ones, a multimodal checkpoint's language model is
        renamed and the rest of it skipped. A fused tensor (``checkpoint_names.FUSED``;
        Phi-3) is loaded part by part (``load_stacked``), every part at once; a mixture of
        experts' expert tensors by ``layers.moe.ExpertLoading`` (Mixtral's
        ``block_sparse_moe`` read as ``mlp``).
        """
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        # the KV scales are the checkpoint's, 1.0 where it has none: a reload of a
        # checkpoint without scales does not keep the last one's
        for name, buf in buffers.items():
            if name.endswith(".self_attn.kv_scale"):
                buf.fill_(1.0)
        self.kv_scales_from_checkpoint = False
        loaded: set[str] = set()
        parts: dict[str, set[str]] = {}  # a fused parameter -> its parts loaded, by name
        multimodal = self.cfg.architecture in LANGUAGE_MODEL_OF
        experts = ExpertLoading(self, params, self.cfg.num_experts)
        for name, source in weights:
            original = name
            name = model_name(name, multimodal)
            if name is None:
                continue
            try:
                if experts.load(name, source):
                    continue
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {original!r}: {e}") from None
            prefix, _, tail = name.partition(".self_attn.")
            if tail in KV_SCALE_NAMES:  # not parameters: never required of a checkpoint
                load_kv_scale(buffers[f"{prefix}.self_attn.kv_scale"], KV_SCALE_NAMES[tail],
                              as_source(source).read(), name)
                self.kv_scales_from_checkpoint = True
                continue
            if self._label_rows(name, source):  # the head of a classifier by tokens
                loaded.add("score.weight")
            if name == "lm_head.weight" and (self.cfg.tie_word_embeddings
                                             or self.lm_head is None):
                continue
            part = name
            name, shard_id = stacked_name(name)
            param = params.get(name)
            if param is None and name.endswith(".bias") and is_zero(source):
                continue  # AutoGPTQ writes a zero bias for every layer: it adds nothing
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            loader = getattr(param, "weight_loader", None)
            fused = shard_id is None and any(frag in name for frag in FUSED)
            if loader is None:
                copy_into(param, as_source(source).read(), name)
            else:
                try:
                    if fused:
                        self.get_submodule(name.rpartition(".")[0]).load_stacked(param, source)
                    else:
                        loader(param, source, shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {original!r}: {e}") from None
            if shard_id is None:
                loaded.add(name)
            else:
                parts.setdefault(name, set()).add(part)
        for name, got in parts.items():
            loaded |= got
            if got == set(stacked_parts(name)):
                loaded.add(name)
        loaded |= experts.complete()
        return loaded

