"""EngineCore on CPU with a tiny random Llama: continuous batching, chunked prefill,
preemption and prefix caching give exactly the tokens of one-at-a-time greedy decoding,
with the pool integrity checked after every step and the pool free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.test_tiny_models import _hf_model
from tests.model.util import greedy, load, save_hf_folder
from tpserve.model import memory
from tpserve.model.runner import ModelRunner, RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine_core import EngineCore
from tpserve.server.outputs import RequestOutput
from tpserve.server.request_state import RequestState

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("engine")))


def make_core(folder, tokenizer, num_blocks: int, prefix: bool = True, budget: int = 64,
              max_seqs: int = 8) -> EngineCore:
    cfg = RunnerConfig(model=folder, block_size=16, max_model_len=256, max_num_seqs=max_seqs,
                       max_num_batched_tokens=budget,
                       kv_cache_memory=num_blocks * 2 * 2 * 16 * 1 * 16 * 4 * 2)
    runner = ModelRunner(cfg, TPGroup(0, 1, CPU, None))
    return EngineCore(runner, tokenizer, enable_prefix_caching=prefix, check_integrity=True)


def submit(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams):
    outs: list[RequestOutput] = []
    core.add(RequestState(rid, prompt, params, outs.append))
    return outs


def tokens_of(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.deltas if d.index == index for t in d.token_ids]


def run_to_end(core: EngineCore, max_steps: int = 5000) -> int:
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < max_steps
    return steps


def test_batched_greedy_equals_single_sequence_greedy(folder, smollm2_tokenizer):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 70))] for _ in range(10)]
    model, comm = load(folder)
    expected = [greedy(model, comm, p, 20) for p in prompts]
    # 20 blocks of 16 tokens for 10 sequences of up to 90 tokens: preemption must happen;
    # a 64-token budget splits the longer prompts into chunks
    core = make_core(folder, smollm2_tokenizer, num_blocks=20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = [submit(core, f"r{i}", p, params) for i, p in enumerate(prompts)]
    run_to_end(core)
    assert core.counters["num_preemptions_total"] > 0
    for got, want in zip(outs, expected, strict=True):
        assert tokens_of(got) == want
        assert got[-1].finished and got[-1].deltas[-1].finish_reason == "length"
        assert got[-1].num_output_tokens == 20
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def test_prefix_cache_hit_and_n_siblings(folder, smollm2_tokenizer):
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    shared = list(range(1, 50))  # 3 full blocks
    first = submit(core, "a", shared + [7], SamplingParams(temperature=0, max_tokens=4))
    run_to_end(core)
    second = submit(core, "b", shared + [9, 9], SamplingParams(temperature=0, max_tokens=4))
    run_to_end(core)
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 48
    sib = submit(core, "c", shared + [3] * 20,
                 SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True))
    run_to_end(core)
    assert tokens_of(sib, 0) == tokens_of(sib, 1) == tokens_of(sib, 2)
    assert len(tokens_of(sib, 0)) == 6
    assert core.block_manager.num_used_blocks == 0


def test_abort_returns_blocks(folder, smollm2_tokenizer):
    core = make_core(folder, smollm2_tokenizer, num_blocks=30)
    outs = submit(core, "x", list(range(40)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.block_manager.num_used_blocks > 0
    core.abort("x")
    assert outs[-1].finished and outs[-1].deltas[0].finish_reason == "abort"
    assert core.block_manager.num_used_blocks == 0 and not core.has_unfinished
    core.abort("x")  # idempotent


def test_token_budget_follows_live_free_memory(folder, smollm2_tokenizer, monkeypatch):
    core = make_core(folder, smollm2_tokenizer, num_blocks=30, budget=64)
    floor = core.memory_floor
    monkeypatch.setattr("tpserve.server.engine_core.read_memory",
                        lambda device: (floor // 4, floor * 8))
    core._last_read = 0.0
    outs = submit(core, "y", list(range(100)), SamplingParams(temperature=0, max_tokens=2))
    core.step()
    assert core.free_device_memory == floor // 4
    assert core.token_budget == 16  # a quarter of 64
    assert core.stats()["step_token_budget"] == 16
    assert core.requests["y"].seqs[0].num_computed_tokens == 16
    monkeypatch.setattr("tpserve.server.engine_core.read_memory", lambda device: (floor, floor))
    core._last_read = 0.0
    core.step()
    assert core.token_budget == 64
    run_to_end(core)
    assert outs[-1].finished


def test_model_that_does_not_fit_is_refused_with_numbers(folder):
    cfg = RunnerConfig(model=folder, block_size=16, max_model_len=256, kv_cache_memory=4096)
    with pytest.raises(MemoryError, match=r"0 blocks of 16 tokens, but one sequence of "
                                          r"--max-model-len 256 needs 16 blocks"):
        ModelRunner(cfg, TPGroup(0, 1, CPU, None))


def test_memory_plan_explains_the_split(folder):
    cfg = RunnerConfig(model=folder, block_size=16, max_model_len=256, kv_cache_memory=2**20)
    runner = ModelRunner(cfg, TPGroup(0, 1, CPU, None))
    plan = runner.plan
    assert plan.kv_pool == plan.num_blocks * plan.bytes_per_block == runner.kv_pool.nbytes
    assert plan.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, heads, dim
    assert plan.num_blocks == 2**20 // plan.bytes_per_block
    assert plan.weights == sum(p.numel() * 4 for p in runner.model.parameters())
    text = "\n".join(plan.describe())
    for word in ("weights", "activation workspace", "CUDA graphs", "KV pool", "free",
                 f"{plan.num_blocks} blocks x 16 tokens", "concurrent sequences"):
        assert word in text


def test_cpu_kv_budget_rules():
    cpu = torch.device("cpu")
    gib = memory.GiB
    assert memory.kv_budget(cpu, 64 * gib, 40 * gib, 0.5, gib, gib, 0, None)[0] == \
        memory.CPU_DEFAULT_KV_CAP
    assert memory.kv_budget(cpu, 8 * gib, 4 * gib, 0.5, gib, gib // 2, 0, None)[0] == gib // 2
    assert memory.kv_budget(cpu, 8 * gib, 4 * gib, 0.5, gib, gib, 0, 12345)[0] == 12345
    cuda = torch.device("cuda")
    budget, _ = memory.kv_budget(cuda, 100 * gib, 90 * gib, 0.9, 16 * gib, 2 * gib, gib, None)
    assert budget == int(0.9 * 100 * gib) - 10 * gib - 16 * gib - 2 * gib - gib
