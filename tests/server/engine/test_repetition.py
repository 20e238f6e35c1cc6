"""vLLM's ``repetition_detection`` (``SamplingParams.repetition``): the tail check against
a brute-force oracle, and ``EngineCore`` on CPU with the tiny random Llama ending each
output at the first token whose tail repeats, under batching, asynchronous scheduling,
``min_tokens`` and speculative decoding (several tokens kept a step). The oracle is the
same request's output without the rule (greedy; the engine's greedy outputs equal the
model's: ``test_engine_core``), cut where the brute-force check first holds."""

from __future__ import annotations

import random

import pytest

from tests.server.engine.test_engine_core import make_core, run_to_end, submit, tokens_of
from tests.server.engine.test_speculative import SPEC, _never_paused, _prompts
from tpserve.model.sampling_params import RepetitionDetection, SamplingParams
from tpserve.server.engine.repetition import REPETITION_DETECTED, repeats


def _brute(tokens: list[int], rule: RepetitionDetection) -> bool:
    """Some pattern of an allowed size, ``min_count`` times back to back, ends ``tokens``."""
    for size in range(max(rule.min_pattern_size, 1), rule.max_pattern_size + 1):
        span = size * rule.min_count
        if span <= len(tokens):
            copies = [tokens[len(tokens) - span + i * size:][:size]
                      for i in range(rule.min_count)]
            if all(c == copies[0] for c in copies):
                return True
    return False


RULES = [RepetitionDetection(1, 0, 2), RepetitionDetection(3, 0, 3),
         RepetitionDetection(4, 2, 2), RepetitionDetection(6, 6, 2),
         RepetitionDetection(5, 1, 4)]


@pytest.mark.parametrize("rule", RULES)
def test_the_tail_check_equals_the_brute_force_one(rule):
    rng = random.Random(rule.max_pattern_size * 7 + rule.min_count)
    hits = 0
    for _ in range(3000):
        alphabet = rng.randrange(1, 4)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 30))]
        if rng.random() < 0.3:  # a pattern repeated on purpose, maybe one copy short
            pattern = [rng.randrange(9) for _ in range(rng.randrange(1, 7))]
            tokens += pattern * rng.randrange(1, 5)
        got = repeats(tokens, rule)
        assert got == _brute(tokens, rule), (tokens, rule)
        hits += got
    assert 300 < hits < 2700  # both answers are common


def test_the_rule_checks_its_sizes():
    for bad in [(0, 0, 2), (2, 3, 2), (-1, 0, 2), (2, -1, 2), (2, 0, 1), (2, 0, 0), (1025, 0, 2)]:
        with pytest.raises(ValueError, match="repetition_detection"):
            RepetitionDetection(*bad)
    assert RepetitionDetection(3, 0, 2).shortest == 1
    assert RepetitionDetection(3, 2, 2).shortest == 2


# ------------------------------------------------------------------------- engine

MAX_TOKENS = 40


def _expected(free: list[int], rule: RepetitionDetection, min_tokens: int
              ) -> tuple[list[int], str]:
    """The output ``free`` (the model's greedy one) cut at its first repeating tail from
    ``min_tokens`` on, and its finish reason."""
    for k in range(max(min_tokens, 1), len(free) + 1):
        if _brute(free[:k], rule):
            return free[:k], "repetition"
    return free, "length"


def _cases(tiny_llama, tokenizer, prompts, n: int):
    """(prompt, rule, min_tokens, expected tokens, finish reason): the expected output is
    the same request's without the rule (one synchronous engine, room for every
    sequence), cut at its first repeating tail. Checks that some output would have been
    cut before its ``min_tokens``."""
    cases = [(prompt, RULES[i % len(RULES)], (0, 9, 0)[i % 3])
             for i, prompt in enumerate(prompts)]
    core = make_core(tiny_llama, tokenizer, num_blocks=120, max_seqs=len(prompts),
                     async_scheduling=False)
    outs = [submit(core, f"free{i}", prompt, SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, min_tokens=min_tokens))
        for i, (prompt, _, min_tokens) in enumerate(cases)]
    run_to_end(core)
    assert core.stats()["num_preemptions_total"] == 0
    frees = [tokens_of(out) for out in outs]
    assert any(_expected(free, rule, 0) != _expected(free, rule, min_tokens)
               for (_, rule, min_tokens), free in zip(cases, frees, strict=True))
    return [(prompt, rule, min_tokens, *_expected(free, rule, min_tokens))
            for (prompt, rule, min_tokens), free in zip(cases, frees, strict=True)]


def _run(core, cases, n: int):
    outs = [submit(core, f"r{i}", prompt, SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, repetition=rule,
        min_tokens=min_tokens))
        for i, (prompt, rule, min_tokens, _, _) in enumerate(cases)]
    run_to_end(core)
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    for (_, _, _, tokens, reason), out in zip(cases, outs, strict=True):
        last = out[-1].deltas[-1]
        assert tokens_of(out) == tokens
        assert last.finish_reason == reason
        assert last.stop_reason == (REPETITION_DETECTED if reason == "repetition" else None)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_end_at_their_first_repeating_tail(tiny_llama, smollm2_tokenizer,
                                                   async_scheduling):
    """Twelve greedy requests batched (preemption by recompute in twenty blocks), five
    rules, some with min_tokens: each output is the model's own cut at its first repeating
    tail (a third of them loop within 40 tokens, the others run to their length), with or
    without asynchronous scheduling (a stopped sequence's extra token in flight is
    dropped)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(17, 256) for _ in range(rng.randrange(5, 40))]
               for _ in range(12)]
    cases = _cases(tiny_llama, smollm2_tokenizer, prompts, MAX_TOKENS)
    assert sum(reason == "repetition" for *_, reason in cases) == 4
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=20, max_seqs=12,
                     async_scheduling=async_scheduling)
    _run(core, cases, MAX_TOKENS)
    assert core.stats()["num_preemptions_total"] > 0


def test_a_step_keeping_drafts_stops_at_the_repeating_token(tiny_llama, smollm2_tokenizer):
    """Prompt lookups draft several tokens a step along the outputs' cycles, drafts never
    paused: each output still ends exactly at its first repeating tail (kept draft tokens
    after it are dropped)."""
    cases = _cases(tiny_llama, smollm2_tokenizer, _prompts(10, 6), MAX_TOKENS)
    assert 6 <= sum(reason == "repetition" for *_, reason in cases) < 10
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=80, max_seqs=10,
                     speculative=SPEC, draft_backoff=_never_paused())
    _run(core, cases, MAX_TOKENS)
    stats = core.stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0
