"""The host tier of the prefix cache in the engine (CPU, the tiny random Llama): prompts
whose blocks the small device pool evicted are found in the host tier, copied back, and
give exactly the greedy tokens of a fresh computation, one at a time or all at once
(with preemptions, asynchronous steps, the pool's integrity checked after every step)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.util import greedy, load
from tests.server.engine.test_engine_core import run_to_end, submit, tokens_of
from tpserve.model.kv_pool import kv_bytes_per_block
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
PER_BLOCK = kv_bytes_per_block(2, 16, 2, 16, torch.float32)  # the tiny Llama's, 16 tokens


def make_core(folder, tokenizer, num_blocks: int, host_blocks: int,
              max_seqs: int = 8, device: str = "cpu", sleep_mode: bool = False) -> EngineCore:
    cfg = RunnerConfig(model=folder, kv_cache_memory=num_blocks * PER_BLOCK,
                       kv_offloading_bytes=host_blocks * PER_BLOCK, device=device,
                       kernel_backend="triton" if device == "cuda" else "torch")
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64,
                            max_model_len=256, block_size=16)
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, torch.device(device), None))
    return EngineCore(runner, tokenizer, sched,
                      EngineConfig(check_integrity=True, enable_sleep_mode=sleep_mode))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(100)] for _ in range(6)]  # 6 full blocks + 4


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    model, comm = load(tiny_llama)
    return [greedy(model, comm, p, 8) for p in prompts]


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _one_at_a_time(core, prompts, tag):
    outs = []
    for i, p in enumerate(prompts):
        outs.append(submit(core, f"{tag}{i}", p, PARAMS))
        run_to_end(core)
    return outs


def test_evicted_prefixes_come_back_from_the_host_tier(tiny_llama, smollm2_tokenizer,
                                                       prompts, expected):
    # 20 blocks hold two finished prompts' blocks and a third running; the tier holds all
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, host_blocks=64)
    assert core.runner.host_kv.num_slots == 64
    first = _one_at_a_time(core, prompts, "a")
    stats = core.stats()
    assert stats["kv_offload_stored_blocks_total"] > 0
    assert stats["kv_offload_loaded_blocks_total"] == 0
    assert stats["prefix_cache_hits_total"] == 0
    second = _one_at_a_time(core, prompts, "b")
    for got, again, want in zip(first, second, expected, strict=True):
        assert tokens_of(got) == tokens_of(again) == want
        assert got[-1].num_cached_tokens == 0
        assert again[-1].num_cached_tokens == 96  # every full block, from either tier
    stats = core.stats()
    # each prompt's blocks had left the pool by the time it came back (the pool holds
    # two prompts; the four before it evicted them): all 36 were loaded, none computed
    assert stats["kv_offload_loaded_blocks_total"] == 36
    assert stats["prefix_cache_hits_total"] == 6 * 96
    # every cached block went to the tier once (it is inclusive: a block loaded back and
    # evicted again is still there, and is not copied twice)
    assert stats["kv_offload_stored_blocks_total"] == stats["kv_offload_blocks_used"] == 36
    assert stats["kv_offload_blocks_total"] == 64
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_without_the_tier_the_same_prompts_are_computed_again(tiny_llama, smollm2_tokenizer,
                                                              prompts, expected):
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, host_blocks=0)
    assert core.runner.host_kv is None and core.block_manager.host is None
    _one_at_a_time(core, prompts, "a")
    second = _one_at_a_time(core, prompts, "b")
    assert second[0][-1].num_cached_tokens == 0  # evicted: gone
    assert [tokens_of(o) for o in second] == expected
    assert "kv_offload_loaded_blocks_total" not in core.stats()


def test_all_at_once_with_loads_stores_and_preemptions_in_the_same_steps(
        tiny_llama, smollm2_tokenizer, prompts, expected):
    """Every prompt again at once, over a pool that holds two of them and a tier that
    holds four: admissions load host blocks, evictions store others (overwriting the
    tier's oldest), a sequence is preempted; every answer is still the greedy one."""
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, host_blocks=24)
    _one_at_a_time(core, prompts, "a")
    outs = [submit(core, f"b{i}", p, PARAMS) for i, p in enumerate(prompts)]
    run_to_end(core)
    assert [tokens_of(o) for o in outs] == expected
    stats = core.stats()
    assert stats["kv_offload_loaded_blocks_total"] > 0
    assert stats["num_preemptions_total"] > 0
    assert stats["kv_offload_stored_blocks_total"] > 24  # the tier's slots were reused
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_a_prompt_waits_for_its_loads_while_another_decodes(tiny_llama, smollm2_tokenizer,
                                                           prompts, expected):
    """A prompt back from the tier, arriving while a long answer decodes, is held out of
    the step that lists its loads (the decode runs alone), computed in a later step that
    joins them, and still gives the greedy tokens."""
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, host_blocks=64)
    _one_at_a_time(core, prompts, "a")
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    decoding = submit(core, "long", prompts[5], long)
    for _ in range(3):
        core.step()
    again = submit(core, "again", prompts[0], PARAMS)
    loaded = core.stats()["kv_offload_loaded_blocks_total"]
    core.step()  # admits it and lists its loads, but runs only the decode
    seq = core.scheduler.running[-1]
    assert core.stats()["kv_offload_loaded_blocks_total"] == loaded + 6
    assert seq.num_computed_tokens == 96 and seq.num_output_tokens == 0
    run_to_end(core)
    assert tokens_of(again) == expected[0] and again[-1].num_cached_tokens == 96
    assert len(tokens_of(decoding)) == 40


def word_tokenizer():
    """A real tokenizer of the tiny Llama's 256 ids, one word each (the GPU machines do
    not carry the embedded SmolLM2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream: GPU only")
def test_on_cuda_loads_beside_the_steps_give_the_greedy_tokens(tiny_llama, prompts, expected):
    """The all-at-once traffic on the GPU (float32), where loads run on the copy stream
    beside the steps and sequences wait for them: every answer is the CPU's greedy one."""
    core = make_core(tiny_llama, word_tokenizer(), num_blocks=20, host_blocks=24,
                     device="cuda")
    _one_at_a_time(core, prompts, "a")
    outs = [submit(core, f"b{i}", p, PARAMS) for i, p in enumerate(prompts)]
    run_to_end(core)
    assert [tokens_of(o) for o in outs] == expected
    assert core.stats()["kv_offload_loaded_blocks_total"] > 0
    assert core.block_manager.host_loads.next_batch > 0


def test_a_size_that_holds_no_block_is_refused(tiny_llama):
    cfg = RunnerConfig(model=tiny_llama, kv_cache_memory=20 * PER_BLOCK,
                       kv_offloading_bytes=PER_BLOCK - 1)
    limits = SchedulerConfig(max_num_seqs=8, max_model_len=256, block_size=16).limits
    with pytest.raises(ValueError, match=f"--kv-offloading-size: {PER_BLOCK - 1} bytes over 1 "
                                         f"rank\\(s\\) hold no KV block of {PER_BLOCK} bytes"):
        ModelRunner(cfg, limits, TPGroup(0, 1, CPU, None))


def test_the_host_tier_outlives_a_sleep_until_reset_external(tiny_llama, smollm2_tokenizer,
                                                            prompts, expected):
    """A level-1 sleep forgets the device's cached blocks (the pool's content is gone) but
    keeps the host tier's: a prompt it holds is loaded back after the wake-up; vLLM's
    reset_external forgets those too, and so does a level-2 sleep."""
    from tpserve.server.engine.queries import run_query

    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, host_blocks=64,
                     sleep_mode=True)
    _one_at_a_time(core, prompts, "a")
    run_query(core, ("sleep", 1, "abort"))
    run_query(core, ("wake_up", None))
    again = _one_at_a_time(core, prompts[:1], "b")
    assert tokens_of(again[0]) == expected[0] and again[0][-1].num_cached_tokens == 96
    assert run_query(core, ("reset_prefix_cache", False, True)) is True
    third = _one_at_a_time(core, prompts[1:2], "c")
    assert tokens_of(third[0]) == expected[1] and third[0][-1].num_cached_tokens == 0
    core.block_manager.check_integrity()
    # a level-2 sleep forgets them: its wake-up reads a checkpoint a trainer may rewrite
    _one_at_a_time(core, prompts, "d")
    run_query(core, ("sleep", 2, "abort"))
    run_query(core, ("wake_up", None))
    fourth = _one_at_a_time(core, prompts[:1], "e")
    assert tokens_of(fourth[0]) == expected[0] and fourth[0][-1].num_cached_tokens == 0
