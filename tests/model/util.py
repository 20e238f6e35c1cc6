"""Test helpers: run our model through the paged KV pool, and write Hugging Face folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tpserve.model.attention.backend import select_attention
from tpserve.model.kernels.backend import select_ops
from tpserve.model.kv_pool import KVPool
from tpserve.model.loader.build import build_model
from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.parallel.comm import Communicator
from tpserve.parallel.state import TPGroup

CPU = torch.device("cpu")


def load(model_path: str | None, group: TPGroup | None = None, load_format: str = "auto",
         kv_dtype: torch.dtype = torch.float32, backend: str = "torch",
         tp_comm: str = "allreduce", quant_method=None, k_hadamard: bool = False,
         max_positions: int = 512, hf_overrides: str | None = None, lm_head: bool = True,
         expert_parallel: bool = False):
    """Our float32 model on CPU, on the torch ops and the given attention back-end (with
    ``k_hadamard``: ``model/kv_hadamard``) and linear-layer ``quant_method`` (e.g.
    ``Fp8LinearMethod()``), its RoPE table ``max_positions`` long; ``hf_overrides``
    (canonical JSON) laid over the config; ``lm_head`` False: a pooling runner's model;
    ``expert_parallel``: a mixture of experts' experts whole on each rank."""
    group = group or TPGroup(0, 1, CPU, None)
    ckpt = open_checkpoint(model_path, load_format, hf_overrides=hf_overrides)
    comm = Communicator(group)
    attn = select_attention(backend, kv_dtype, k_hadamard)
    return build_model(ckpt, comm, CPU, torch.float32, select_ops("torch"), attn,
                       max_positions, tp_comm=tp_comm, quant_method=quant_method,
                       lm_head=lm_head, expert_parallel=expert_parallel), comm


def load_resolved(path: str, quantization: str, group: TPGroup, backend: str = "torch",
                  dtype: torch.dtype = torch.float32):
    """``(model, comm, method)``: ``path`` built as the runner builds it on the CPU, its
    ``--quantization`` resolved against the checkpoint's own and the linear method picked
    from both (``backend``: the kernels the method runs)."""
    from tpserve.model.quant.methods import linear_method, resolve_quantization

    ckpt = open_checkpoint(path)
    resolved = resolve_quantization(quantization, ckpt.quantization)
    method = linear_method(resolved, backend, CPU, dtype, 32, ckpt.quantization)
    comm = Communicator(group)
    model = build_model(ckpt, comm, CPU, dtype, select_ops("torch"),
                        select_attention("torch", dtype), 512, quant_method=method)
    return model, comm, method


def new_pool(model, comm, num_blocks: int = 64, block_size: int = 16,
             device: torch.device = CPU) -> KVPool:
    """A pool in the model's attention back-end's KV cache dtype, on ``device``."""
    cfg = model.cfg
    return KVPool(cfg.num_hidden_layers, num_blocks, block_size,
                  cfg.kv_heads_for(comm.world_size), cfg.head_dim,
                  model.attn_backend.kv_cache_dtype, device)


@torch.no_grad()
def run(model, pool: KVPool, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
    """One step of ``chunks`` on ``pool``'s device; the logits of the sampled rows (all
    rows with ``all_logits``)."""
    attn = model.attn_backend
    plan = StepPlan.build(chunks, pool.block_size, attn)
    if pool.buffer.device.type != "cpu":
        plan = plan.to(pool.buffer.device)
    hidden = model(plan.input_ids, plan.positions, pool.layers, plan.metadata(attn))
    return model.compute_logits(hidden if all_logits else hidden[plan.logits_indices])


def full_logits(model, comm, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position from one prefill of the whole sequence."""
    pool = new_pool(model, comm)
    nblocks = -(-len(token_ids) // pool.block_size)
    return run(model, pool, [SeqChunk(token_ids, 0, list(range(nblocks)), True)], True)


@torch.no_grad()
def graphs_and_eager(rc, limits, steps: list[list[SeqChunk]], check=None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On a GPU: the outputs (float32, on the CPU) of ``steps`` run by a ``ModelRunner`` of
    ``rc`` (``RunnerConfig``) through its captured CUDA graphs, then by one with
    ``enforce_eager``; ``check(runner)`` is called on each before it runs."""
    from dataclasses import replace

    from tpserve.model.runner import ModelRunner

    outs = []
    for c in (rc, replace(rc, enforce_eager=True)):
        runner = ModelRunner(c, limits, TPGroup(0, 1, torch.device("cuda", 0), None))
        if check is not None:
            check(runner)
        outs.append([runner.execute(StepPlan.build(chunks, limits.block_size, runner.attn))
                     .float().cpu() for chunks in steps])
        del runner
    return outs[0], outs[1]


def whole_and_stepped(model, comm, tokens: list[int], prefill: int, chunk: int
                      ) -> list[torch.Tensor]:
    """Every position's logits two ways: one whole prefill; and a ``prefill``-token
    prefill, a ``chunk``-token chunk over its cache, then one decode step per token."""
    blocks = list(range(-(-len(tokens) // 16)))
    whole = run(model, new_pool(model, comm), [SeqChunk(tokens, 0, blocks, True)], True)
    pool = new_pool(model, comm)
    cut = prefill + chunk
    parts = [run(model, pool, [SeqChunk(tokens[:prefill], 0, blocks, True)], True),
             run(model, pool, [SeqChunk(tokens[prefill:cut], prefill, blocks, True)], True)]
    parts += [run(model, pool, [SeqChunk([t], p, blocks, True)])
              for p, t in enumerate(tokens[cut:], start=cut)]
    return [whole, torch.cat(parts)]


def greedy(model, comm, prompt: list[int], n: int) -> list[int]:
    pool = new_pool(model, comm)
    blocks = list(range(pool.num_blocks))
    ids = list(prompt)
    logits = run(model, pool, [SeqChunk(ids, 0, blocks, True)])
    out = []
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = run(model, pool, [SeqChunk([tok], len(ids), blocks, True)])
        ids.append(tok)
    return out


def greedy_answers(model_path, tokenizer, prompts: list[str], n: int
                   ) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids and the texts of their ``n`` greedy tokens, from the model
    at ``model_path`` (float32, CPU, one rank): the oracle of the servers' greedy tests."""
    model, comm = load(str(model_path))
    ids = [tokenizer(p).input_ids for p in prompts]
    return ids, [tokenizer.decode(greedy(model, comm, i, n)) for i in ids]


def save_hf_folder(model, folder: Path, num_shards: int = 2) -> Path:
    """Saves a transformers model as ``num_shards`` safetensors files plus their index."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    names = sorted(state)
    per = -(-len(names) // num_shards)
    weight_map = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def embedded_state(ckpt) -> dict[str, torch.Tensor]:
    """The embedded GGUF's (``ckpt = open_checkpoint(None)``) weights dequantized to float32,
    by Hugging Face name (its tied ``lm_head.weight`` included)."""
    from tpserve.model.loader import gguf_file

    return {name: src.read().float().contiguous()
            for name, src in gguf_file.iter_weights(ckpt.reader, ckpt.config)}


def save_embedded_folder(folder: Path, ckpt, tensors: dict[str, torch.Tensor],
                         tokenizer=None, **config) -> Path:
    """``tensors`` as a Hugging Face folder of the embedded model ``ckpt``: one safetensors
    file, ``hf_config`` with ``config`` over it, and its tokenizer (or ``tokenizer``)."""
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(ckpt.config, **config)))
    (tokenizer or ckpt.tokenizer()).save_pretrained(str(folder))
    return folder


def hf_config(c, **overrides) -> dict:
    """A Hugging Face ``config.json`` (Llama) for our ``ModelConfig`` ``c``, with
    ``overrides``."""
    return {"architectures": [c.architecture], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
            "eos_token_id": list(c.eos_token_ids), **overrides}


@torch.no_grad()
def tiny_hf_model(cfg, architecture: str, biases: bool = False,
                  scaled: tuple[tuple[str, ...], float] | None = None):
    """transformers' float32 model of ``cfg`` (as ``architecture``), its norms (and with
    ``biases`` its biases) moved off their initial values by N(0, 0.1) noise so that they
    are really tested, and the parameters whose names end in ``scaled[0]`` multiplied by
    ``scaled[1]``."""
    import transformers as tf

    cfg.architectures = [architecture]
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    for name, p in model.named_parameters():
        if "norm" in name or (biases and name.endswith("bias")):
            p.add_(torch.randn_like(p) * 0.1)
        if scaled is not None and name.endswith(scaled[0]):
            p.mul_(scaled[1])
    return model


@torch.no_grad()
def copy_dequantized_layer(mine, theirs, cfg, mlps=None) -> None:
    """Our tp 1 fp8 decoder layer's attention and MLP weights, dequantized, into
    transformers' layer ``theirs``: q/k/v and o, and each ``(our MLP, their MLP)`` of
    ``mlps`` (default: the layers' own ``mlp``) gate/up and down."""
    def dequantized(layer):
        return layer.weight.float() * layer.weight_scale.float().reshape(-1, 1)

    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    att = theirs.self_attn
    for name, w in zip(("q_proj", "k_proj", "v_proj"),
                       dequantized(mine.self_attn.qkv_proj).split([q, kv, kv]), strict=True):
        getattr(att, name).weight.copy_(w)
    att.o_proj.weight.copy_(dequantized(mine.self_attn.o_proj))
    for my_mlp, their_mlp in mlps or [(mine.mlp, theirs.mlp)]:
        gate, up = dequantized(my_mlp.gate_up_proj).chunk(2)
        their_mlp.gate_proj.weight.copy_(gate)
        their_mlp.up_proj.weight.copy_(up)
        their_mlp.down_proj.weight.copy_(dequantized(my_mlp.down_proj))


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_state(state: dict[str, torch.Tensor], scales: str = "channel"
              ) -> dict[str, torch.Tensor]:
    """``state`` with every linear weight stored as an FP8 checkpoint stores it: e4m3 codes
    plus ``weight_scale``, ``[out, 1]`` per output channel (``quantize_per_row`` with the
    searched scales: what ``--quantization fp8`` quantizes with) or one ``[]`` scale per
    tensor (the tensor's amax / 448). Everything else is kept as is."""
    from tpserve.model.quant.fp8 import quantize_per_row, searched_amax

    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] not in LINEAR_NAMES or not name.endswith(".weight"):
            out[name] = w
            continue
        amax = (searched_amax(w, w.abs().amax(dim=-1, keepdim=True).float())
                if scales == "channel" else w.abs().amax().float().expand(w.shape[0], 1))
        q, scale = quantize_per_row(w, amax)
        out[name] = q
        out[name + "_scale"] = scale.contiguous() if scales == "channel" else scale[0, 0].clone()
    return out


def fp8_block_state(state: dict[str, torch.Tensor], block: tuple[int, int],
                    scale_name: str = "weight_scale_inv") -> dict[str, torch.Tensor]:
    """``state`` with every linear weight stored as a block-wise FP8 checkpoint stores it:
    e4m3 codes plus ``scale_name`` ``[ceil(out / bn), ceil(in / bk)]``, each block's amax /
    448 (the codes of a block are its values over its scale)."""
    from tpserve.model.quant.fp8 import FP8, FP8_MAX, MIN_SCALE

    bn, bk = block
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] not in LINEAR_NAMES or not name.endswith(".weight"):
            out[name] = w
            continue
        n, k = w.shape
        rb, cb = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(w.float(), (0, cb * bk - k, 0, rb * bn - n))
        amax = padded.abs().reshape(rb, bn, cb, bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        out[name] = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[name.removesuffix("weight") + scale_name] = scale
    return out


def fp8_quantization_config(fmt: str = "fp8", strategy: str = "channel",
                            static: bool = False, block: tuple[int, int] | None = None
                            ) -> dict:
    """``config.json``'s ``quantization_config`` as vLLM's ``Fp8Config`` or llm-compressor's
    compressed-tensors FP8-dynamic export writes it (``static``: the FP8 export with static
    per-tensor activation scales, ``neuralmagic/*-FP8``; ``block``: block-wise weight
    scales, transformers' FineGrainedFP8 / llm-compressor's ``FP8_BLOCK``)."""
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
              "ignored_layers": ["lm_head"]}
        if block is not None:
            qc["weight_block_size"] = list(block)
        return qc
    activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                    "dynamic": False} if static else
                   {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                    "dynamic": True})
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False}
    if block is not None:
        activations.update(strategy="group", group_size=block[1])
        weights.update(strategy="block", block_structure=list(block))
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": weights, "input_activations": activations}}}


def save_fp8_folder(source: Path, folder: Path, scales: str = "channel",
                    fmt: str = "fp8", input_scales: dict[str, float] | None = None,
                    block: tuple[int, int] | None = None) -> Path:
    """Rewrites the unquantized folder ``source`` (``save_hf_folder``'s) as an FP8 checkpoint
    in ``folder``: the same shards with ``fp8_state``'s tensors, and ``config.json`` with
    its ``quantization_config``; ``input_scales`` (checkpoint weight name -> scale, every
    linear weight's) makes it a checkpoint with static activation scales, each stored as
    the ``[]`` float32 ``input_scale`` beside its weight; ``block`` a block-wise one
    (``fp8_block_state``)."""
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    weight_map = {}
    for fname in sorted(set(index["weight_map"].values())):
        state = load_file(str(source / fname))
        part = (fp8_state(state, scales) if block is None else fp8_block_state(
            state, block, "weight_scale_inv" if fmt == "fp8" else "weight_scale"))
        for name in [n for n in part if n.endswith("_scale")] if input_scales else ():
            weight = name.removesuffix("_scale")
            part[weight.removesuffix("weight") + "input_scale"] = torch.tensor(
                input_scales[weight], dtype=torch.float32)
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config(fmt, scales,
                                                            static=bool(input_scales),
                                                            block=block)
    (folder / "config.json").write_text(json.dumps(config))
    for extra in source.iterdir():  # tokenizer files, generation config
        if extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            (folder / extra.name).write_bytes(extra.read_bytes())
    return folder


GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down",
                    # Phi-3's fused tensors, kept fused by llama.cpp
                    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


# the fp16 scale of random blocks, by type: weights of about 0.01 - 0.1
RANDOM_BLOCK_SCALE = {"Q8_0": 1e-3, "Q4_0": 1e-2, "Q4_1": 1e-2, "Q5_0": 5e-3, "Q5_1": 5e-3,
                      "Q2_K": 3e-3, "Q3_K": 5e-4, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 3e-5}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, cols / columns * nbytes]``: blocks of GGML type ``kind`` with random
    bytes (every code, scale and min pattern) but for their fp16 ``d`` (and ``dmin`` or
    ``m``), drawn of either sign around ``RANDOM_BLOCK_SCALE``."""
    from tpserve.model.loader.gguf_blocks import BLOCK_TYPES

    t = BLOCK_TYPES[kind]
    n = cols // t.columns
    raw = rng.integers(0, 256, (rows, n, t.nbytes), dtype=np.uint8)
    for i, at in enumerate(t.halves):
        half = (rng.uniform(0.5, 1.5, (rows, n)) * rng.choice([-1, 1], (rows, n))
                * RANDOM_BLOCK_SCALE[kind]).astype(np.float16)
        if i and t.columns == 256:
            half = np.abs(half) * 4  # a K-quant's dmin: the mins subtract
        raw[..., at:at + 2] = half.view(np.uint8).reshape(rows, n, 2)
    return raw.reshape(rows, -1)


def recompose_blocks(t, form, heads=None, dim=None, start=0, length=None) -> torch.Tensor:
    """A GGUF tensor record ``t`` read as its codes, scales and zero points (or offsets) in
    ``form`` (``gguf_integer.Form``; rows ``start ..`` or, with ``dim`` 1, columns ``start
    ..``; ``heads``: llama.cpp's q/k permutation undone) and recomposed in float32:
    ``(q - zero) * s`` or ``q * s + offset``."""
    from tpserve.model.loader.gguf_integer import GGUFBlocks

    parts = [GGUFBlocks(t, part, heads, form) for part in ("codes", "scales", "zeros")]
    codes, scales, zeros = (
        p.read(dim, start // (p.unit if dim == 1 else 1),
               None if length is None else length // (p.unit if dim == 1 else 1))
        for p in parts)
    assert codes.dtype == torch.int16 and scales.dtype == torch.float32
    s = scales.repeat_interleave(form.group, 1)[:, :codes.shape[1]]
    z = zeros.float().repeat_interleave(form.group, 1)[:, :codes.shape[1]]
    if form.offset:
        assert zeros.dtype == torch.float32
        return codes.float() * s + z
    assert zeros.dtype == torch.uint8
    return (codes.float() - z) * s


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _safe(v: np.ndarray) -> np.ndarray:
    return np.where(v == 0, 1, v)


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` float32 ``[rows, cols]`` (cols a multiple of 256) -> uint8 blocks of
    ``Q4_K`` or ``Q6_K`` (a plain min/max fit per sub-block, not llama.cpp's search; the
    ``gguf`` package dequantizes but cannot quantize these types)."""
    rows = values.shape[0]
    if kind == "Q4_K":
        b = values.reshape(-1, 8, 32).astype(np.float32)
        lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
        scale, mn = (hi - lo) / 15, -lo
        d = (scale.max(-1) / 63).astype(np.float16)
        dmin = (mn.max(-1) / 63).astype(np.float16)
        sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), 0, 63)
        m = np.clip(np.round(mn / _safe(dmin.astype(np.float32))[:, None]), 0, 63)
        s, z = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
        q = np.clip(np.round((b + z[..., None]) / _safe(s)[..., None]), 0, 15).astype(np.uint8)
        sc, m = sc.astype(np.uint8), m.astype(np.uint8)
        packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                                 m[:, :4] | ((m[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=-1)
        qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
        out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)
    elif kind == "Q6_K":
        b = values.reshape(-1, 16, 16).astype(np.float32)
        scale = np.abs(b).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), 0, 127)
        s = d.astype(np.float32)[:, None] * sc
        q = np.clip(np.round(b / _safe(s)[..., None]) + 32, 0, 63).astype(np.uint8)
        q = q.reshape(-1, 2, 128)  # [superblock, half, 128]
        ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)
        qh = sum(((q[..., 32 * t:32 * t + 32] >> 4) & 3) << (2 * t) for t in range(4))
        out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64).astype(np.uint8),
                              sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)
    else:
        raise ValueError(kind)
    return out.reshape(rows, -1)


def _converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's ``LlamaModel.permute``: each head's rows reordered for its
    rotary layout (the loader undoes it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def save_gguf_file(model, path: Path, arch: str, write_metadata=None,
                   extra_tensors: dict | None = None, layer_names: dict | None = None,
                   norm_shift: float = 0.0, state: dict | None = None,
                   linear_type=None, linear_blocks=None) -> Path:
    """A transformers model's weights as a float32 GGUF file of llama.cpp's ``arch``: its
    metadata keys and tensor names, ``llama``'s (and ``granite``'s) q/k rows permuted as the converter permutes
    them (Qwen's are not), no ``output.weight`` when the embeddings are tied;
    ``write_metadata(writer)`` adds keys, ``extra_tensors`` (name -> numpy array) tensors;
    ``layer_names`` laid over ``GGUF_LAYER_NAMES``; ``norm_shift`` added to every norm
    weight (Gemma's converter stores ``1 + w``); ``state`` written instead of the model's
    ``state_dict()`` (tensors renamed or split as llama.cpp's converter would);
    ``linear_type`` (a ``gguf.GGMLQuantizationType``) quantizes the decoder layers' 2-d
    linear weights to it by ``gguf.quants.quantize``, as llama.cpp's quantizer does;
    ``linear_blocks(gguf_name, values)`` -> ``(raw uint8 blocks, qtype)`` writes blocks of
    its own instead (types the package cannot quantize: the K-quants, ``quantize_k``)."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", cfg.num_hidden_layers),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", head_dim),
                       ("vocab_size", cfg.vocab_size),
                       ("context_length", cfg.max_position_embeddings)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = cfg.rope_parameters  # per layer type (Gemma 3): the full layers' base
    w.add_float32(f"{arch}.rope.freq_base", (rope.get("full_attention") or rope)["rope_theta"])
    if write_metadata is not None:
        write_metadata(w)
    names = {**GGUF_LAYER_NAMES, **(layer_names or {})}
    for name, t in (model.state_dict() if state is None else state).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            part, _, kind = rest.rpartition(".")
            gname = f"blk.{layer}.{names[part]}.{kind}"
            if arch in ("llama", "granite") and part == "self_attn.q_proj":
                t = _converter_permute(t, cfg.num_attention_heads)
            elif arch in ("llama", "granite") and part == "self_attn.k_proj":
                t = _converter_permute(t, cfg.num_key_value_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if gname.endswith("norm.weight"):
            t = t + norm_shift
        linear = gname.startswith("blk.") and t.dim() == 2 and not gname.endswith("norm.weight")
        if linear_blocks is not None and linear:
            raw, qtype = linear_blocks(gname, t.float().numpy())
            w.add_tensor(gname, raw, raw_dtype=qtype)
            continue
        if linear_type is not None and linear:
            w.add_tensor(gname, gguf.quants.quantize(t.float().numpy(), linear_type),
                         raw_dtype=linear_type)
            continue
        w.add_tensor(gname, t.float().numpy())
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_tokenizer_gguf(path: Path, arch: str, metadata: dict) -> Path:
    """A GGUF file of llama.cpp's ``arch`` holding a tokenizer (``metadata``: its
    ``tokenizer.*`` keys, by Python type: bools, ints as uint32, strings, lists as arrays)
    beside a one-layer shape and a zero embedding: what a tokenizer's conversion reads."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 1), ("embedding_length", 8),
                       ("attention.head_count", 2), ("feed_forward_length", 16)]:
        w.add_uint32(f"{arch}.{key}", value)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.add_tensor("token_embd.weight",
                 np.zeros((len(metadata["tokenizer.ggml.tokens"]), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_checkpoints(tmp_path_factory, make_model, tokens_of):
    """A module fixture's body: kind -> (folder, transformers' logits over
    ``tokens_of(kind)``), each tiny checkpoint (``make_model(kind)``) written once."""
    made: dict[str, tuple[str, torch.Tensor]] = {}

    def get(kind: str) -> tuple[str, torch.Tensor]:
        if kind not in made:
            hf = make_model(kind)
            folder = save_hf_folder(hf, tmp_path_factory.mktemp(kind))
            with torch.no_grad():
                made[kind] = (str(folder), hf(torch.tensor([tokens_of(kind)])).logits[0])
        return made[kind]

    return get


def assert_same_steps(ref_model, model, comm, steps: list[list[SeqChunk]],
                      device: torch.device, num_blocks: int = 4) -> None:
    """``steps`` through the torch reference ``ref_model`` (CPU) and ``model`` (another
    back-end, on ``device``, each with a float32 pool of its own): the same logits."""
    ref_pool = new_pool(ref_model, comm, num_blocks=num_blocks)
    pool = KVPool(model.cfg.num_hidden_layers, num_blocks, 16, model.cfg.kv_heads_for(1),
                  model.cfg.head_dim, torch.float32, device)
    for step in steps:
        want = run(ref_model, ref_pool, step)
        plan = StepPlan.build(step, 16, model.attn_backend).to(device)
        with torch.no_grad():
            hidden = model(plan.input_ids, plan.positions, pool.layers,
                           plan.metadata(model.attn_backend))
            got = model.compute_logits(hidden[plan.logits_indices])
        torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=2e-4)
