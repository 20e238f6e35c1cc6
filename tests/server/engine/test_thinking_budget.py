"""A thinking budget (``SamplingParams.thinking``, vLLM's ``thinking_token_budget``) in
``EngineCore`` on CPU with the tiny random Llama: the count (``server/engine/thinking``),
the one-token mask, and the engine forcing the end tag exactly where the budget is spent,
under batching, asynchronous scheduling, preemption, n > 1 and speculative decoding. The
oracle is the model's own greedy choice token by token, with the end tag put in by hand
where the count says so."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.util import greedy, load
from tests.server.engine.test_engine_core import make_core, run_to_end, submit, tokens_of
from tests.server.engine.test_speculative import SPEC, _never_paused, _prompts
from tpserve.model.sampling_params import SamplingParams, ThinkingBudget
from tpserve.model.token_bitmask import unpack_bitmask
from tpserve.server.engine.thinking import DONE, START, THINKING, ForcedToken, ThinkingCount

START_ID, END_ID = 7, 9  # tags for the count's own tests


def _counted(budget: ThinkingBudget, tokens: list[int]) -> ThinkingCount:
    count = ThinkingCount(budget)
    for t in tokens:
        count.accept(t)
    return count


def test_the_count_reads_the_output_as_the_reasoning_split_does():
    opens = ThinkingBudget(2, START_ID, END_ID, opens=True)
    closed = ThinkingBudget(2, START_ID, END_ID, opens=False)
    # no output yet: an opened thinking may have to end at once (budget 0), a closed one
    # never (its first token may be the start tag)
    assert not ThinkingCount(opens).must_end()
    assert ThinkingCount(ThinkingBudget(0, START_ID, END_ID, True)).must_end()
    assert not ThinkingCount(ThinkingBudget(0, START_ID, END_ID, False)).must_end()
    # a leading start tag opens the thinking either way and is not counted
    for b in (opens, closed):
        c = _counted(b, [START_ID, 1])
        assert (c.phase, c.count, c.must_end()) == (THINKING, 1, False)
        c.accept(2)
        assert (c.phase, c.count, c.must_end()) == (THINKING, 2, True)
        c.accept(END_ID)
        assert (c.phase, c.must_end(), c.may_end(1)) == (DONE, False, False)
    # any other first token: thinking when it opens (counted), else the answer
    assert (_counted(opens, [1]).phase, _counted(opens, [1]).count) == (THINKING, 1)
    assert _counted(closed, [1]).phase == DONE
    assert _counted(closed, [1, START_ID, 2, 3]).phase == DONE  # a later tag is content
    assert _counted(opens, [END_ID]).phase == DONE  # empty thinking
    # the model ending its thinking itself: nothing is forced after it
    c = _counted(opens, [1, END_ID, 2, 3, 4])
    assert (c.phase, c.count, c.must_end()) == (DONE, 1, False)


def test_may_end_covers_the_token_still_in_flight():
    b = ThinkingBudget(3, START_ID, END_ID, opens=True)
    c = _counted(b, [1])
    assert not c.may_end(1)  # at most 2 counted after the pending one
    c.accept(2)
    assert c.may_end(1) and not c.must_end()  # the pending one may make it 3
    assert c.may_end(0) == c.must_end()
    closed = ThinkingCount(ThinkingBudget(1, START_ID, END_ID, opens=False))
    assert not closed.may_end(0)
    assert closed.may_end(1)  # the pending first token may open it, then 1 may follow
    assert not ThinkingCount(ThinkingBudget(2, START_ID, END_ID, False)).may_end(1)


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63, 255, 49151])
def test_the_forced_mask_allows_exactly_its_token(token):
    width = (49152 + 31) // 32
    bits = torch.full((3, width), -1, dtype=torch.int32)
    ForcedToken(token).fill_next_token_bitmask(bits, 1)
    allowed = unpack_bitmask(bits, 49152)
    assert allowed[1].nonzero().flatten().tolist() == [token]
    assert allowed[0].all() and allowed[2].all()  # other rows untouched


def test_sampling_params_refuse_a_budget_whose_end_cannot_be_sampled():
    b = ThinkingBudget(4, START_ID, END_ID, opens=True)
    with pytest.raises(ValueError, match="thinking_token_budget must be at least 0"):
        ThinkingBudget(-1, START_ID, END_ID, True)
    with pytest.raises(ValueError, match="thinking_token_budget needs the end"):
        SamplingParams(thinking=b, allowed_token_ids=(1, 2))
    with pytest.raises(ValueError, match="thinking_token_budget needs the end"):
        SamplingParams(thinking=b, bad_words_token_ids=((3, END_ID),))
    SamplingParams(thinking=b, allowed_token_ids=(1, END_ID), bad_words_token_ids=((END_ID, 3),))


# ------------------------------------------------------------------------- engine

MAX_TOKENS = 14


def _expected(model, comm, prompt: list[int], budget: ThinkingBudget, n: int) -> list[int]:
    """The greedy output under ``budget``: the model's choice, or the end tag where the
    count is spent."""
    count, out = ThinkingCount(budget), []
    while len(out) < n:
        token = budget.end_id if count.must_end() else greedy(model, comm, prompt + out, 1)[0]
        out.append(token)
        count.accept(token)
    return out


@pytest.fixture(scope="module")
def cases(tiny_llama):
    """(prompt, budget, expected greedy output) for prompts of the tiny model: thinking
    opened by the prompt (budgets 0 to 5), opened by the model's first token (the start
    tag is what it writes first), ended by the model itself before its budget, and a
    closed one the model never opens."""
    model, comm = load(tiny_llama)
    rng = random.Random(3)
    cases = []
    for i in range(10):
        prompt = [rng.randrange(17, 256) for _ in range(rng.randrange(5, 40))]
        free = greedy(model, comm, prompt, MAX_TOKENS)
        unused = next(t for t in range(17, 256) if t not in free)
        if i < 6:  # opened by the prompt; the end tag a token the model never writes here
            budget = ThinkingBudget(i, unused, unused + 1 if unused + 1 not in free else 3,
                                    opens=True)
        elif i < 8:  # the model's first token is the start tag
            budget = ThinkingBudget(2 + i - 6, free[0], unused, opens=False)
        elif i == 8:  # the model writes the end tag itself, before its budget
            budget = ThinkingBudget(MAX_TOKENS, unused, free[3], opens=True)
        else:  # not opened: the first token is not the start tag, nothing is forced
            budget = ThinkingBudget(0, unused, free[1], opens=False)
        cases.append((prompt, budget, _expected(model, comm, prompt, budget, MAX_TOKENS)))
    forced = [c for c in cases if c[2] != greedy(model, comm, c[0], MAX_TOKENS)]
    assert len(forced) == 8  # the last two run as the model would without a budget
    return cases


def _run_cases(core, cases, n: int = 1, temperature: float = 0.0,
               max_tokens: int = MAX_TOKENS, **params) -> list[list[list[int]]]:
    outs = [submit(core, f"r{i}", prompt, SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, thinking=budget, n=n,
        temperature=temperature, **params))
        for i, (prompt, budget, _) in enumerate(cases)]
    run_to_end(core)
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return [[tokens_of(o, k) for k in range(n)] for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_end_is_forced_where_the_budget_is_spent(tiny_llama, smollm2_tokenizer, cases,
                                                     async_scheduling):
    """Ten greedy requests batched, twenty blocks for them (preemption by recompute): each
    output is its oracle, the end tag exactly where its budget was spent, with or without
    asynchronous scheduling (the tokens in flight when a row may have to end)."""
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, max_seqs=10,
                     async_scheduling=async_scheduling)
    got = _run_cases(core, cases)
    assert [g[0] for g in got] == [expected for _, _, expected in cases]
    assert core.stats()["num_preemptions_total"] > 0


def test_speculative_decoding_drafts_nothing_past_a_budget(tiny_llama, smollm2_tokenizer):
    """Prompts repeating a segment (prompt lookups draft from the first step; the random
    model's outputs fall into cycles the drafts then follow) with budgets of 10, 15 and 20
    opened by the prompt, drafts never paused: every output is still its oracle (drafts
    accepted across the budget skip the end tag in some of them), and drafts ran once the
    thinking was done."""
    model, comm = load(tiny_llama)
    cases, n = [], 30
    for i, prompt in enumerate(_prompts(8, 5)):
        free = greedy(model, comm, prompt, n)
        end = next(t for t in range(17, 256) if t not in free)
        budget = ThinkingBudget((10, 15, 20)[i % 3], end + 1, end, opens=True)
        cases.append((prompt, budget, _expected(model, comm, prompt, budget, n)))
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=80, max_seqs=10,
                     speculative=SPEC, draft_backoff=_never_paused())
    got = _run_cases(core, cases, max_tokens=n)
    assert [g[0] for g in got] == [expected for _, _, expected in cases]
    assert core.stats()["spec_decode_num_drafts_total"] > 0


def test_seeded_siblings_each_end_at_their_own_count(tiny_llama, smollm2_tokenizer, cases):
    """Two seeded siblings a request, sampled at temperature 1: each sibling's count is its
    own (its end tag right after its budget's worth of thinking, unless it wrote the tag
    first), and asynchronous scheduling draws exactly what synchronous steps do."""
    runs = []
    for async_scheduling in (True, False):
        core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=80, max_seqs=20,
                         async_scheduling=async_scheduling)
        runs.append(_run_cases(core, cases, n=2, temperature=1.0, seed=11))
    assert runs[0] == runs[1]
    ends = 0
    for (_, budget, _), siblings in zip(cases, runs[0], strict=True):
        assert siblings[0] != siblings[1]
        for out in siblings:
            count = ThinkingCount(budget)
            for token in out:
                assert token == budget.end_id or not count.must_end()
                ends += count.must_end()
                count.accept(token)
            assert count.phase in (START, THINKING, DONE)
    assert ends >= 8
