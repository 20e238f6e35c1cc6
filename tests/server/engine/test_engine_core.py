"""EngineCore on CPU with a tiny random Llama: continuous batching, chunked prefill,
preemption and prefix caching give exactly the tokens of one-at-a-time greedy decoding,
with the pool integrity checked after every step and the pool free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.util import greedy, load
from tpserve.model import memory
from tpserve.model.fault import FAULT_ENV
from tpserve.model.plan import StepLimits
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
LIMITS = StepLimits(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=256,
                    block_size=16)


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


class Readings:
    """Free-memory readings a test sets: the engine's memory reader in these tests."""

    def __init__(self, free: int):
        self.free = free

    def __call__(self, device: torch.device) -> tuple[int, int]:
        return self.free, 64 << 30


def make_core(folder, tokenizer, num_blocks: int, prefix: bool = True, budget: int = 64,
              max_seqs: int = 8, async_scheduling: bool = True,
              max_mixed_tokens: int | None = None, readings: Readings | None = None,
              compile_hook=None, policy: str = "fcfs", speculative=None,
              draft_backoff=None) -> EngineCore:
    cfg = RunnerConfig(model=folder, kv_cache_memory=num_blocks * 2 * 2 * 16 * 1 * 16 * 4 * 2)
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                            max_model_len=256, block_size=16, max_mixed_tokens=max_mixed_tokens,
                            enable_prefix_caching=prefix, policy=policy)
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, CPU, None))
    engine = EngineConfig(check_integrity=True, async_scheduling=async_scheduling,
                          speculative=speculative)
    if readings is None:
        return EngineCore(runner, tokenizer, sched, engine, compile_hook=compile_hook,
                          draft_backoff=draft_backoff)
    return EngineCore(runner, tokenizer, sched, engine, read_memory=readings,
                      memory_read_interval_s=0.0, compile_hook=compile_hook,
                      draft_backoff=draft_backoff)


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


def test_priority_preemptions_on_arrival_keep_every_greedy_token(folder, smollm2_tokenizer):
    """Under the priority policy, with asynchronous steps: requests of later priorities
    run, then higher-priority ones arrive mid-run and take their blocks and seats (the
    victims' in-flight tokens dropped, their KV recomputed); every request still gets
    exactly its greedy tokens, and the high ones finish before the low ones."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    model, comm = load(folder)
    expected = [greedy(model, comm, p, 16) for p in prompts]
    core = make_core(folder, smollm2_tokenizer, num_blocks=16, max_seqs=4, policy="priority")
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, priority=p)
              for p in (3, 3, 2, 2, 0, -1, 0, -2)]
    outs = [submit(core, f"r{i}", prompts[i], params[i]) for i in range(4)]
    for _ in range(6):
        core.step()
    assert not any(o and o[-1].finished for o in outs)
    outs += [submit(core, f"r{i}", prompts[i], params[i]) for i in range(4, 8)]
    finished: list[int] = []
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < 5000
        finished += [i for i, o in enumerate(outs) if i not in finished and o and o[-1].finished]
    assert core.counters["num_preemptions_total"] > 0
    for got, want in zip(outs, expected, strict=True):
        assert tokens_of(got) == want
    assert set(finished[:4]) == {4, 5, 6, 7}  # every late high priority before any low one
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def _mixed_requests(stop_id: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    def prompt(n):
        return [rng.randrange(256) for _ in range(n)]
    return {
        "greedy": (prompt(40), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "seeded": (prompt(9), SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=10,
                                             ignore_eos=True)),
        "stop_id": (prompt(21), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                               stop_token_ids=(stop_id,))),
        "logprobs": (prompt(5), SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                               ignore_eos=True)),
        "min_tokens": (prompt(70), SamplingParams(temperature=0.5, seed=1, max_tokens=8,
                                                  min_tokens=8)),
        "short": (prompt(3), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    }


def _outcome(outs: list[RequestOutput]):
    deltas = [d for o in outs for d in o.deltas]
    return ([(d.index, d.text, d.token_ids, d.finish_reason, d.logprobs) for d in deltas],
            outs[-1].finished, outs[-1].num_output_tokens)


@pytest.mark.parametrize("penalty", [False, True])
def test_async_scheduling_changes_no_output(folder, smollm2_tokenizer, penalty):
    """Launching each step before reading back the last one's tokens gives exactly the
    outputs of the synchronous engine: tokens, text, logprobs, finish reasons (early stops
    included), with the pool free at the end. A penalty request makes every step fall back
    to synchronous, and the outputs still match."""
    model, comm = load(folder)
    stop_id = greedy(model, comm, _mixed_requests(0)["stop_id"][0], 6)[4]
    requests = _mixed_requests(stop_id)
    if penalty:
        requests["penalty"] = (list(range(30, 60)), SamplingParams(
            temperature=0, max_tokens=9, repetition_penalty=1.5, frequency_penalty=0.3,
            ignore_eos=True))
    results, pending_steps = [], []
    for mode in (False, True):
        core = make_core(folder, smollm2_tokenizer, num_blocks=24, budget=48,
                         async_scheduling=mode, max_mixed_tokens=20)
        plans = []
        upload = core.runner.upload  # every step's plan goes through it
        core.runner.upload = lambda plan, upload=upload, plans=plans: (
            plans.append(plan), upload(plan))[1]
        sample, penalized = core.sampler.sample, []

        def checked(logits, params, prompts, outputs, *rest, sample=sample,
                    penalized=penalized):
            for p, out in zip(params, outputs, strict=True):
                if p.repetition_penalty != 1:  # its history must be real tokens
                    assert -1 not in out
                    penalized.append(len(out))
            return sample(logits, params, prompts, outputs, *rest)
        core.sampler.sample = checked
        outs = {rid: submit(core, rid, p, params) for rid, (p, params) in requests.items()}
        run_to_end(core)
        results.append({rid: _outcome(o) for rid, o in outs.items()})
        pending_steps.append(sum(p.pending_rows.shape[0] > 0 for p in plans))
        assert penalized == (list(range(9)) if penalty else [])
        assert core.block_manager.num_used_blocks == 0
        assert max(p.num_tokens for p in plans if p.num_decodes) <= 20  # the mixed cap
    assert results[0] == results[1]
    stop = results[1]["stop_id"][0]
    assert stop[-1][3] == "stop" and stop[-1][2] == (stop_id,) and len(stop) == 5
    assert pending_steps[0] == 0
    assert pending_steps[1] > 5


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


def test_token_budget_follows_live_free_memory(folder, smollm2_tokenizer):
    readings = Readings(8 << 30)
    core = make_core(folder, smollm2_tokenizer, num_blocks=30, budget=64, readings=readings)
    floor = core.budget.floor
    readings.free = floor // 4
    outs = submit(core, "y", list(range(100)), SamplingParams(temperature=0, max_tokens=2))
    core.step()
    assert core.budget.free == floor // 4
    assert core.budget.budget == 16  # a quarter of 64
    assert core.stats()["step_token_budget"] == 16
    assert core.requests["y"].seqs[0].num_computed_tokens == 16
    readings.free = floor
    core.step()
    assert core.budget.budget == 64
    run_to_end(core)
    assert outs[-1].finished


def _oom_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    reqs = {f"g{i}": ([rng.randrange(256) for _ in range(rng.randrange(5, 40))],
                      SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            for i in range(6)}
    reqs["seeded"] = ([rng.randrange(256) for _ in range(17)],
                      SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=12,
                                     ignore_eos=True))
    return reqs


def _run_oom_requests(core: EngineCore) -> tuple[dict, list]:
    plans = []
    upload = core.runner.upload
    core.runner.upload = lambda plan: (plans.append(plan), upload(plan))[1]
    reqs = _oom_requests()
    outs = {rid: submit(core, rid, p, params) for rid, (p, params) in reqs.items()}
    run_to_end(core)
    assert all(o[-1].finished for o in outs.values())
    # per sibling: tokens, text and finish reason (siblings' deltas may interleave
    # differently once one was preempted)
    return {(rid, i): (tokens_of(o, i), "".join(d.text for x in o for d in x.deltas
                                               if d.index == i),
                       [d.finish_reason for x in o for d in x.deltas if d.index == i][-1])
            for rid, o in outs.items() for i in range(reqs[rid][1].n)}, plans


@pytest.mark.parametrize("site", ["oom", "oom-sample"])
def test_a_step_that_runs_out_of_memory_is_dropped_whole(folder, smollm2_tokenizer,
                                                         monkeypatch, site):
    """An out-of-memory error in the forward or in sampling (after the samples were stored
    for the next step) at a step that decodes on placeholders: every request still ends
    with exactly the tokens of an unfaulted run (greedy and seeded: the seeded rows'
    generators are rewound), pool integrity holds after every step, and every block is
    back in the pool at the end."""
    want, _ = _run_oom_requests(make_core(folder, smollm2_tokenizer, num_blocks=40))
    monkeypatch.setenv(FAULT_ENV, f"0:6:{site}")
    core = make_core(folder, smollm2_tokenizer, num_blocks=40, readings=Readings(8 << 30))
    got, plans = _run_oom_requests(core)
    assert core.counters["oom_recoveries_total"] == 1
    assert core.counters["num_preemptions_total"] >= 1
    assert plans[5].pending_rows.shape[0] > 0  # the failed step read the sampled buffer
    assert got == want
    assert all(len(tokens) == 12 and reason == "length" for tokens, _, reason in got.values())
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert core.budget.hold is not None  # the readings never showed room again


def test_budget_stays_reduced_until_readings_show_room(folder, smollm2_tokenizer,
                                                       monkeypatch):
    """After an out-of-memory step the budget is capped at half that step; readings below
    ``free_at_oom + need`` keep the cap however many steps run (the memory-proportional
    budget alone would be full again), and readings that reach it grow the cap step-wise
    back to the full budget, where the hold ends."""
    monkeypatch.setenv(FAULT_ENV, "0:2:oom-sample")
    readings = Readings(8 << 30)
    core = make_core(folder, smollm2_tokenizer, num_blocks=60, budget=64, readings=readings)
    rng = random.Random(5)
    outs = [submit(core, f"r{i}", [rng.randrange(256) for _ in range(60)],
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            for i in range(3)]
    while not core.counters["oom_recoveries_total"]:
        core.step()
    hold = core.budget.hold
    assert hold is not None and hold.cap == 32 and core.budget.budget == 32  # half of 64
    assert hold.free_at_oom == 8 << 30 and hold.need > 0
    readings.free = hold.room - 1  # more than the floor: the full budget but for the hold
    for _ in range(5):
        core.step()
        assert core.budget.budget == 32 and core.budget.hold is hold
    readings.free = hold.room
    core.step()
    assert core.budget.budget == 64 and core.budget.hold is None  # 32 -> 64: the full budget
    run_to_end(core)
    assert all(o[-1].finished and o[-1].num_output_tokens == 40 for o in outs)
    assert core.block_manager.num_used_blocks == 0


def test_model_that_does_not_fit_is_refused_with_numbers(folder):
    cfg = RunnerConfig(model=folder, kv_cache_memory=4096)
    with pytest.raises(MemoryError, match=r"0 blocks of 16 tokens, but one sequence of "
                                          r"--max-model-len 256 needs 16 blocks"):
        ModelRunner(cfg, LIMITS, TPGroup(0, 1, CPU, None))


def test_memory_plan_explains_the_split(folder):
    cfg = RunnerConfig(model=folder, kv_cache_memory=2**20)
    runner = ModelRunner(cfg, LIMITS, TPGroup(0, 1, CPU, None))
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


def test_a_multi_token_bad_word_sees_the_previous_token_under_async_scheduling(
        folder, smollm2_tokenizer):
    """The ban of a two-token bad word needs the token just sampled: such rows finalize
    each step before the next is scheduled (as penalties do), so with asynchronous
    scheduling the word's first token is still generated and its second never follows."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=20)
    prompt = list(range(5, 30))
    plain = submit(core, "plain", prompt, SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True))
    run_to_end(core)
    t = tokens_of(plain)
    banned = submit(core, "banned", prompt, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, bad_words_token_ids=((t[0], t[1]),)))
    run_to_end(core)
    got = tokens_of(banned)
    assert got[0] == t[0] and got[1] != t[1]
    assert core.block_manager.num_used_blocks == 0


def test_cache_salt_keeps_prefix_caches_apart(folder, smollm2_tokenizer):
    """vLLM's ``cache_salt``: a prompt's cached blocks serve only requests with the same
    salt (none serves none: the unsalted cache is its own)."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    prompt = list(range(1, 50))  # 3 full blocks
    cached = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", None), ("d", "tenant-1"),
                      ("e", None)):
        outs = submit(core, rid, prompt + [7], SamplingParams(temperature=0, max_tokens=2,
                                                              cache_salt=salt))
        run_to_end(core)
        cached[rid] = outs[-1].num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 48, "e": 48}
    assert core.block_manager.num_used_blocks == 0


def test_each_sequence_is_timed_as_a_request(folder, smollm2_tokenizer):
    """The queue, prefill and decode histograms observe each of a request's ``n``
    sequences once (as vLLM, whose engine runs each as a request), its decode up to its
    own finish."""
    core = make_core(folder, smollm2_tokenizer, num_blocks=40)
    submit(core, "one", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True))
    outs = submit(core, "three", list(range(30, 50)),
                  SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True))
    run_to_end(core)
    counts = {name: core.histograms[f"request_{name}_time_seconds"].count
              for name in ("queue", "prefill", "decode")}
    assert counts == {"queue": 4, "prefill": 4, "decode": 4}
    finished = [d.index for o in outs for d in o.deltas if d.finish_reason is not None]
    assert sorted(finished) == [0, 1, 2]
