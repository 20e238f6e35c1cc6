"""A model runner's start-up profile: the activation workspace the memory plan reserves
(the allocator's peak over the largest steps, ``profile_workspace``) and the warm-up that
compiles every kernel variant before serving (``warm_kernels``). Both run on every rank in
lockstep (the forwards' collectives), before the KV pool is sized / after it is built."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tpserve.model.cuda_graphs import buckets_for
from tpserve.model.kv_pool import KVPool
from tpserve.model.memory import estimate_activation_bytes
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.model.pooling import PoolRows, sum_rows

if TYPE_CHECKING:
    from tpserve.model.runner import ModelRunner


def profile_workspace(runner: ModelRunner) -> tuple[int, bool]:
    """Activation workspace bytes: on GPU the allocator's peak over one forward at
    ``max_num_batched_tokens`` (plus the logits of ``max_num_seqs`` rows); on CPU an
    estimate. The same forward warms the caching allocator for steady state."""
    lim, m = runner.limits, runner.model_config
    tokens = lim.max_num_batched_tokens
    # a pooling runner has no logits: its rows are pooled sums, [rows, hidden] float32
    rows = 0 if runner.cfg.pooling else min(lim.max_num_seqs, tokens)
    if runner.device.type != "cuda":
        tp = runner.comm.world_size
        heads = m.head_layout(tp)
        q = (heads.heads_per_rank + 2 * heads.kv_heads_per_rank) * m.head_dim
        est = estimate_activation_bytes(tokens, m.hidden_size,
                                        m.mlp_activation_columns(tp), q, m.vocab_size,
                                        rows, runner.dtype.itemsize)
        return est, False
    # pass 1: pure prefill of the whole budget; pass 2: a mixed step of (rows - 1)
    # decodes plus prefill, so the allocator also sees the shapes of serving steps
    prefill_only = profile_chunks(runner, [], tokens)
    mixed = profile_chunks(runner, [1] * (rows - 1), tokens - (rows - 1))
    nblocks = max(sum(len(c.block_ids) for c in p) for p in (prefill_only, mixed))
    tmp = KVPool(m.num_hidden_layers, nblocks, lim.block_size,
                 m.kv_heads_for(runner.comm.world_size), m.head_dim, runner.kv_dtype,
                 runner.device)
    plans = [StepPlan.build(c, lim.block_size, runner.attn).to(runner.device)
             for c in (prefill_only, mixed)]
    if runner.lora is not None:
        runner.lora.all_base()
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    base = torch.cuda.memory_allocated(runner.device)
    with torch.inference_mode():
        for plan in plans:
            hidden = runner.model(plan.input_ids, plan.positions, tmp.layers,
                                  plan.metadata(runner.attn))
            if runner.cfg.pooling:  # every row pooled (a MEAN step's largest work)
                every = torch.arange(hidden.shape[0])
                sum_rows(hidden, PoolRows(every, torch.zeros_like(every), 1))
            else:
                idx = torch.arange(rows, device=runner.device) % hidden.shape[0]
                logits = runner.model.compute_logits(hidden[idx]).float()
                torch.sort(logits.softmax(-1), dim=-1)
                del logits
            del hidden
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - base
    del tmp
    # hand the profile's cached segments back: from here on the allocator holds only
    # what the plan counts (weights, buffers; then the KV pool, graphs, activations)
    torch.cuda.empty_cache()
    return int(peak), True


def warm_kernels(runner: ModelRunner) -> None:
    """Runs small mixed steps (d decodes at short and full context plus one prefill
    chunk) for every decode batch bucket, so Triton compiles each kernel variant
    (split counts, batch-offset specialisations) at start-up, not under load. The
    steps write into free blocks of the pool, which are overwritten before use."""
    bs = runner.limits.block_size
    nblocks = min(runner.max_blocks_per_seq, runner.kv_pool.num_blocks)
    table = list(range(nblocks))
    if runner.lora is not None:
        runner.lora.all_base()
    for d in buckets_for(runner.limits.max_num_seqs):
        contexts = {nblocks * bs} | {c for c in (16, 64, 256, 1024, 4096, 16384, 65536)
                                    if c < nblocks * bs}
        for ctx in sorted(contexts):
            chunks = [SeqChunk([0], ctx - 1, table, True) for _ in range(d)]
            chunks.append(SeqChunk([0] * bs, 0, table[:1], True))
            plan = StepPlan.build(chunks, bs, runner.attn).to(runner.device)
            with torch.inference_mode():
                hidden = runner.model(plan.input_ids, plan.positions,
                                      runner.kv_pool.layers, plan.metadata(runner.attn))
                if not runner.cfg.pooling:
                    runner.model.compute_logits(hidden[plan.logits_indices])
    torch.cuda.synchronize(runner.device)


def profile_chunks(runner: ModelRunner, decodes: list[int], prefill_tokens: int
                   ) -> list[SeqChunk]:
    """Chunks of a profiling step: single-token decodes, then prefills of at most
    ``max_model_len`` tokens, each sequence on its own consecutive blocks."""
    bs, chunks, first = runner.limits.block_size, [], 0
    sizes = decodes + [min(runner.max_model_len, prefill_tokens - i)
                       for i in range(0, max(prefill_tokens, 0), runner.max_model_len)]
    for n in sizes:
        nb = math.ceil(n / bs)
        chunks.append(SeqChunk([0] * n, 0, list(range(first, first + nb)), True))
        first += nb
    return chunks
