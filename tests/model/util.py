"""Test helpers: run our model through the paged KV pool, and write Hugging Face folders."""

from __future__ import annotations

import json
from pathlib import Path

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
         tp_comm: str = "allreduce", quant_method=None):
    """Our float32 model on CPU, on the torch ops and the given attention back-end (and
    linear-layer ``quant_method``, e.g. ``Fp8LinearMethod()``)."""
    group = group or TPGroup(0, 1, CPU, None)
    ckpt = open_checkpoint(model_path, load_format)
    comm = Communicator(group)
    attn = select_attention(backend, kv_dtype)
    return build_model(ckpt, comm, CPU, torch.float32, select_ops("torch"), attn, 512,
                       tp_comm=tp_comm, quant_method=quant_method), comm


def new_pool(model, comm, num_blocks: int = 64, block_size: int = 16) -> KVPool:
    """A pool in the model's attention back-end's KV cache dtype."""
    cfg = model.cfg
    return KVPool(cfg.num_hidden_layers, num_blocks, block_size,
                  cfg.kv_heads_for(comm.world_size), cfg.head_dim,
                  model.attn_backend.kv_cache_dtype, CPU)


@torch.no_grad()
def run(model, pool: KVPool, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
    attn = model.attn_backend
    plan = StepPlan.build(chunks, pool.block_size, attn)
    hidden = model(plan.input_ids, plan.positions, pool.layers, plan.metadata(attn))
    return model.compute_logits(hidden if all_logits else hidden[plan.logits_indices])


def full_logits(model, comm, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position from one prefill of the whole sequence."""
    pool = new_pool(model, comm)
    nblocks = -(-len(token_ids) // pool.block_size)
    return run(model, pool, [SeqChunk(token_ids, 0, list(range(nblocks)), True)], True)


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
