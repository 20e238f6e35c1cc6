"""Embeddings through EngineCore (``--runner pooling``) on CPU with the tiny Llama: every
pooled vector equals transformers' final-normed hidden states pooled the same way (last
token, mean, first), in float32, whether the prompt is prefilled in one step or in
chunks, batched with others, after prefix-cache hits (taken by LAST only), or after
preemption; ``dimensions`` and ``normalize`` as sentence-transformers apply them; the
pool is free at the end, and a runner answers only its own kind of request."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.test_tiny_models import _hf_model
from tests.server.engine.test_engine_core import run_to_end, submit
from tpserve.model.pooling import PoolerConfig
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
rng = random.Random(3)
PROMPTS = [[rng.randrange(256) for _ in range(n)] for n in (40, 1, 17, 33, 5, 64, 90)]


@pytest.fixture(scope="module")
def hidden():
    """transformers' final-normed hidden states of each prompt (float32)."""
    model = _hf_model("llama")
    with torch.no_grad():
        return [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def expected(h: torch.Tensor, kind: str, normalize: bool = True,
             dimensions: int | None = None) -> torch.Tensor:
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def pooling_core(folder, tokenizer, num_blocks: int = 40, budget: int = 64,
                 prefix: bool = True, async_scheduling: bool = True,
                 pooler: PoolerConfig | None = None, max_model_len: int = 256,
                 policy: str = "fcfs") -> EngineCore:
    cfg = RunnerConfig(model=folder, kv_cache_memory=num_blocks * 2 * 2 * 16 * 16 * 4 * 2,
                       runner="pooling", pooler=pooler or PoolerConfig())
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, block_size=16,
                            enable_prefix_caching=prefix, policy=policy)
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, CPU, None))
    return EngineCore(runner, tokenizer, sched,
                      EngineConfig(check_integrity=True, async_scheduling=async_scheduling))


@pytest.fixture(scope="module")
def core(tiny_llama, smollm2_tokenizer):
    return pooling_core(tiny_llama, smollm2_tokenizer)


def embed(core: EngineCore, prompts, **pooling) -> list[list]:
    outs = [submit(core, f"e{i}-{random.random()}", p,
                   SamplingParams(pooling=PoolingParams(**pooling)))
            for i, p in enumerate(prompts)]
    run_to_end(core)
    return outs


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("budget", [64, 7])
def test_pooled_vectors_equal_transformers(tiny_llama, smollm2_tokenizer, hidden, kind,
                                           budget):
    core = pooling_core(tiny_llama, smollm2_tokenizer, budget=budget)
    for outs, h in zip(embed(core, PROMPTS, pooling_type=kind), hidden, strict=True):
        last = outs[-1]
        assert last.finished and last.error is None
        assert [d.finish_reason for o in outs for d in o.deltas] == ["stop"]
        assert len(last.embedding) == 64
        assert close(last.embedding, expected(h, kind)), kind
        assert last.num_prompt_tokens == h.shape[0] and last.num_output_tokens == 0
    assert core.block_manager.num_used_blocks == 0


def test_normalize_and_dimensions(core, hidden):
    raw = embed(core, PROMPTS[:1], pooling_type="MEAN", normalize=False)[0][-1].embedding
    assert close(raw, expected(hidden[0], "MEAN", normalize=False))
    assert abs(torch.tensor(raw).norm().item() - 1.0) > 0.1  # really not normalized
    cut = embed(core, PROMPTS[:1], pooling_type="LAST", dimensions=16)[0][-1].embedding
    assert len(cut) == 16 and close(cut, expected(hidden[0], "LAST", dimensions=16))
    assert abs(torch.tensor(cut).norm().item() - 1.0) < 1e-5


def test_last_takes_prefix_cache_hits_mean_does_not(core, hidden):
    """A repeated prompt hits the prefix cache: LAST computes only what is left and
    still equals transformers; MEAN and CLS recompute every row."""
    p, h = PROMPTS[5], hidden[5]
    embed(core, [p], pooling_type="LAST")
    for kind in ("LAST", "MEAN", "CLS"):
        out = embed(core, [p], pooling_type=kind)[0][-1]
        assert close(out.embedding, expected(h, kind)), kind
        assert (out.num_cached_tokens > 0) == (kind == "LAST"), kind
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_preemption_pools_again_from_the_first_position(tiny_llama, smollm2_tokenizer, hidden,
                                                        async_scheduling, kind):
    """Under priority scheduling, a 90-token prompt is preempted after its first 64-token
    chunk by a request ranked before it that finds no free block; it is pooled again from
    position 0 and still equals transformers."""
    core = pooling_core(tiny_llama, smollm2_tokenizer, num_blocks=6, prefix=False,
                        async_scheduling=async_scheduling, max_model_len=96,
                        policy="priority")
    def params(priority: int) -> SamplingParams:
        return SamplingParams(pooling=PoolingParams(pooling_type=kind), priority=priority)
    late = submit(core, "late", PROMPTS[6], params(1))
    core.step()
    first = submit(core, "first", PROMPTS[0], params(0))
    run_to_end(core)
    assert core.counters["num_preemptions_total"] == 1
    assert close(late[-1].embedding, expected(hidden[6], kind))
    assert close(first[-1].embedding, expected(hidden[0], kind))
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("steps", [1, 3])
def test_abort_frees_the_blocks(tiny_llama, smollm2_tokenizer, steps):
    """Aborted mid-prompt (16-token chunks of a 40-token prompt), or after its last chunk
    was launched: the request ends once, without an embedding, and the pool is free."""
    core = pooling_core(tiny_llama, smollm2_tokenizer, budget=16)
    outs = submit(core, "gone", PROMPTS[0], SamplingParams(pooling=PoolingParams()))
    for _ in range(steps):
        core.step()
    core.abort("gone")
    run_to_end(core)
    assert len(outs) == 1 and outs[0].finished and outs[0].embedding is None
    assert [d.finish_reason for d in outs[0].deltas] == (["abort"] if steps == 1 else [])
    assert core.block_manager.num_used_blocks == 0 and not core.requests


def test_each_runner_answers_only_its_kind(core, tiny_llama, smollm2_tokenizer):
    with pytest.raises(ValueError, match="answers embedding requests only"):
        core.add(RequestState("g", [1, 2], SamplingParams(max_tokens=2), lambda _: None))
    cfg = RunnerConfig(model=tiny_llama, kv_cache_memory=1 << 20)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                            block_size=16)
    gen = EngineCore(ModelRunner(cfg, sched.limits, TPGroup(0, 1, CPU, None)),
                     smollm2_tokenizer, sched)
    with pytest.raises(ValueError, match="cannot answer embedding requests"):
        gen.add(RequestState("p", [1, 2], SamplingParams(pooling=PoolingParams()),
                             lambda _: None))
    assert not core.requests and not gen.requests


def test_a_pooling_runner_has_no_lm_head(core):
    assert core.runner.model.lm_head is None
    assert not any(n.startswith("lm_head") for n, _ in core.runner.model.named_parameters())
    assert core.runner.graphs is None
