"""A KV cache dtype other than the model's (``--kv-cache-dtype``): the pool is allocated in
it, its blocks cost its bytes, and a float32 model over a bfloat16 or float16 cache decodes
the same greedy tokens as over a float32 cache.

Tolerance: the cache rounds each K/V element once, to 8 significant bits in bfloat16
(relative error <= 2^-9) and 11 in float16 (<= 2^-12). Attention is a convex combination
of V rows plus scores perturbed by q.dk, so each layer's output moves by about that
relative error; the logits of the tiny model then move by a few times
``2^-9 * max|logit|`` at most. We allow ``2^-7 * max|logit|`` for bfloat16 (measured:
about 2^-9.4) and ``2^-10 * max|logit|`` for float16 (measured: about 2^-12.6). The greedy
tokens are compared exactly: the run is deterministic and its top-2 margins exceed the
measured error at every step of these prompts.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.test_tiny_models import TOKENS
from tests.model.util import load, new_pool, run
from tpserve.model.kv_pool import KVPool, kv_bytes_per_block
from tpserve.model.plan import SeqChunk, StepLimits
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.parallel.state import TPGroup

CPU = torch.device("cpu")
REL_TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


def greedy_with_logits(model, comm, prompt: list[int], n: int
                       ) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``prompt`` (one prefill, then one decode per token) and the
    logits each token was taken from."""
    pool = new_pool(model, comm)
    assert pool.buffer.dtype == model.attn_backend.kv_cache_dtype
    blocks = list(range(pool.num_blocks))
    ids = list(prompt)
    logits = run(model, pool, [SeqChunk(ids, 0, blocks, True)])[0]
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = run(model, pool, [SeqChunk(tokens[-1:], len(ids), blocks, True)])[0]
        ids.append(tokens[-1])
    return tokens, torch.stack(seen)


def assert_same_greedy(folder: str, kv_dtype: torch.dtype, backend: str, n: int) -> None:
    want, want_logits = greedy_with_logits(*load(folder), TOKENS, n)
    got, got_logits = greedy_with_logits(*load(folder, kv_dtype=kv_dtype, backend=backend),
                                         TOKENS, n)
    assert got == want
    tol = REL_TOL[kv_dtype] * want_logits.abs().max().item()
    assert (got_logits - want_logits).abs().max().item() <= tol


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cache_gives_the_same_greedy_tokens_on_the_torch_backend(folder,
                                                                                kv_dtype):
    assert_same_greedy(folder, kv_dtype, "torch", 32)


def test_bytes_per_block_follow_the_kv_dtype(folder):
    assert kv_bytes_per_block(2, 16, 2, 16, torch.bfloat16) * 2 == \
        kv_bytes_per_block(2, 16, 2, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    pool = KVPool(2, 3, 16, 2, 16, torch.bfloat16, CPU)
    assert pool.nbytes == 3 * kv_bytes_per_block(2, 16, 2, 16, torch.bfloat16)
    limits = StepLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                        block_size=16)
    runners = {kv: ModelRunner(RunnerConfig(model=folder, kv_cache_dtype=kv,
                                            kv_cache_memory=2**20),
                               limits, TPGroup(0, 1, CPU, None))
               for kv in ("float32", "bfloat16")}
    full, half = runners["float32"].plan, runners["bfloat16"].plan
    assert runners["bfloat16"].kv_pool.buffer.dtype == torch.bfloat16
    assert runners["bfloat16"].model.lm_head.weight.dtype == torch.float32  # model stays fp32
    assert half.bytes_per_block * 2 == full.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert half.num_blocks == 2 * full.num_blocks  # the same budget holds twice the blocks
