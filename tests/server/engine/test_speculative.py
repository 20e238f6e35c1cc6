"""Speculative decoding by prompt lookup (``engine/speculative.py``, ``--speculative-config``
method "ngram"): the draft lookup, the tokens kept, the scheduler's room for drafts, and
the engine on the tiny Llama (CPU, float32), where every request keeps exactly the tokens,
text, finish and log-probabilities it gets without speculation, in fewer steps, with the
pool's integrity checked after every step and every block back at the end."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.model.util import full_logits, load
from tests.server.engine.test_engine_core import (
    CPU,
    make_core,
    run_to_end,
    submit,
    tokens_of,
)
from tpserve.model.plan import StepLimits
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams, StructuredOutput
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.block_manager import BlockManager
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.draft_backoff import DraftBackoff
from tpserve.server.engine.drafting import Drafting
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.scheduler import Scheduler, SchedulerConfig
from tpserve.server.engine.sequence import Sequence
from tpserve.server.engine.speculative import (
    SpeculativeConfig,
    draft_for,
    kept_tokens,
    lookup_draft,
)

LIMITS = StepLimits(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                    block_size=16)
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Token-id prompts (the tiny model's 256 ids) repeating a random segment, so lookups
    find drafts from the start; the random model's outputs fall into cycles, which drafts
    then follow (some drafts are right, some wrong)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        seg = [rng.randrange(256) for _ in range(rng.randrange(4, 12))]
        prompts.append([rng.randrange(256) for _ in range(3)] + seg * 3 + seg[:2])
    return prompts


# ------------------------------------------------------------------------- lookup


def test_the_longest_suffix_that_occurred_before_drafts_what_followed_it():
    tokens = [7, 1, 2, 3, 9, 9, 4, 2, 3, 8, 5, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 1: what followed it
    assert lookup_draft(tokens, 4, 3, 1) == (9, 9, 4, 2)
    assert lookup_draft(tokens, 2, 3, 1) == (9, 9)
    # only 2-grams: (2, 3)'s latest earlier occurrence is at 7, then 8 and 5 followed
    assert lookup_draft(tokens, 4, 2, 1) == (8, 5, 1, 2)
    # the draft ends where the tokens do
    assert lookup_draft([4, 5, 6, 4, 5], 8, 2, 1) == (6, 4, 5)
    # no earlier occurrence of any n-gram in range: no draft
    assert lookup_draft([1, 2, 3, 4], 4, 3, 1) == ()
    assert lookup_draft([1, 2, 3, 1], 4, 3, 2) == ()
    assert lookup_draft([1, 2, 3, 1], 4, 3, 1) == (2, 3, 1)
    assert lookup_draft([5], 4, 3, 1) == () and lookup_draft([5, 5], 0, 3, 1) == ()
    assert lookup_draft([5, 5], 3, 3, 1) == (5,)


def test_a_repeating_stretch_drafts_k_tokens():
    """The latest occurrence of a repeating stretch's suffix overlaps it: an earlier one,
    or a shorter suffix's, that ``k`` tokens followed is taken first."""
    assert lookup_draft([5] * 6, 3, 3, 1) == (5, 5, 5)
    assert lookup_draft([9, 1, 2, 1, 2, 1, 2], 4, 2, 1) == (1, 2, 1, 2)
    # no occurrence has 3 tokens after it: the latest's 2
    assert lookup_draft([1, 2, 1, 2], 3, 2, 1) == (1, 2)
    assert lookup_draft([7, 1, 2, 3, 4, 1, 2], 3, 2, 1) == (3, 4, 1)


def test_a_byte_match_across_two_tokens_is_not_an_occurrence():
    """Token ids are searched as bytes: 256 then 0 holds the bytes of the id 1 one byte
    into 256; that is no occurrence of 1, so only the real one counts."""
    assert lookup_draft([256, 0, 5, 1], 4, 1, 1) == ()
    assert lookup_draft([1, 6, 256, 0, 5, 1], 4, 1, 1) == (6, 256, 0, 5)


def test_kept_tokens_run_to_the_first_that_differs_from_the_draft():
    assert kept_tokens((), [4]) == [4]
    assert kept_tokens((5, 6, 7), [9, 6, 7, 1]) == [9]
    assert kept_tokens((5, 6, 7), [5, 6, 2, 1]) == [5, 6, 2]
    assert kept_tokens((5, 6, 7), [5, 6, 7, 1]) == [5, 6, 7, 1]


def test_the_config_reads_vllms_json_and_refuses_what_it_cannot_do():
    """Either lookup bound defaults to the other, both to 5, as in vLLM."""
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 5})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_min": 2})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (2, 2)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (4, 4)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    assert (c.prompt_lookup_max, c.prompt_lookup_min, c.num_speculative_tokens) == (4, 1, 3)
    assert c.disable_by_batch_size is None
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3,
                                     "disable_by_batch_size": 8})
    assert c.disable_by_batch_size == 8 and "none above 8 running sequences" in c.describe()
    # vLLM's other spellings of the method: a "model" of ngram or [ngram], "[ngram]"
    want = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3,
                             prompt_lookup_min=3)
    for spelled in ({"model": "ngram"}, {"model": "[ngram]"}, {"method": "[ngram]"},
                    {"method": "ngram", "model": "ngram"}):
        assert SpeculativeConfig.from_json(
            {**spelled, "num_speculative_tokens": 4, "prompt_lookup_max": 3}) == want
    refused = [
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"},
         "model 'x' is a draft model, which tpserve does not run"),
        ({"model": "org/draft", "num_speculative_tokens": 3},
         "\"method\" is required .*model 'org/draft' would be a draft model"),
        ({"method": "eagle", "num_speculative_tokens": 3, "model": "x"},
         "method 'eagle' is not supported"),
        ({"method": "eagle", "num_speculative_tokens": 3},
         "method 'eagle' is not supported \\(it needs a draft model or trained heads"),
        ({"method": "suffix", "num_speculative_tokens": 3},
         "method 'suffix' is not supported \\(tpserve drafts by prompt lookup only\\); "
         "supported: ngram"),
        ({"num_speculative_tokens": 3}, '"method" is required'),
        ({"method": "ngram"}, '"num_speculative_tokens" is required'),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
          "prompt_lookup_min": 3}, "prompt_lookup_min 3 is above prompt_lookup_max 2"),
    ]
    for value, message in refused:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(value)


def test_who_gets_a_draft_and_how_long():
    seq = Sequence(0, "r", 0, [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=5))
    assert draft_for(seq, SPEC, 100, seeded=False) == (3, 1, 2)
    seq.output_token_ids = [3]  # 4 more tokens allowed: 3 drafted and the one after
    assert draft_for(seq, SPEC, 100, seeded=False) == (1, 2, 3)
    assert draft_for(seq, SPEC, 8, seeded=False) == (1,)  # the model's length: 6 + 1 + 1
    assert draft_for(seq, SPEC, 7, seeded=False) == ()
    seq.output_token_ids = [3, 1, 2, 3]  # one token left: none to draft
    assert draft_for(seq, SPEC, 100, seeded=False) == ()
    seeded = Sequence(1, "s", 0, [1, 2, 1], SamplingParams(temperature=1.0, seed=3))
    assert draft_for(seeded, SPEC, 100, seeded=True) == ()
    assert draft_for(seeded, SPEC, 100, seeded=False) == (2, 1)
    greedy_seeded = Sequence(2, "g", 0, [1, 2, 1], SamplingParams(temperature=0, seed=3))
    assert draft_for(greedy_seeded, SPEC, 100, seeded=True) == (2, 1)
    structured = Sequence(3, "j", 0, [1, 2, 1], SamplingParams(
        temperature=0, structured=StructuredOutput("json_object")))
    assert draft_for(structured, SPEC, 100, seeded=False) == ()


# ---------------------------------------------------------------------- scheduler


def _decoding(sched: Scheduler, ids, count: int, prompt_len: int) -> list[Sequence]:
    """``count`` sequences admitted and prefilled, each with one sampled token: decoding."""
    seqs = [Sequence(next(ids), f"r{i}", 0, list(range(prompt_len)),
                     SamplingParams(temperature=0, max_tokens=50)) for i in range(count)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    sched.update(out, {s.seq_id: 1 for s in seqs})
    return seqs


def test_drafts_take_the_room_a_step_has_left_and_never_preempt():
    """Drafts extend decodes in rank order, cut by the sampled rows left (``max_num_seqs``
    a step, one set aside per scheduled sequence), the token budget left and free blocks;
    the step's update counts only the real token as computed, and a kept draft token then
    counts through ``accept_draft_token``."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64,
                                      max_model_len=32, block_size=4), bm)
    ids = itertools.count()
    seqs = _decoding(sched, ids, 2, 6)  # 6 + 1 tokens each: 2 blocks each
    out = sched.schedule(propose=lambda s: (7, 8, 9, 10))
    # 5 rows - 2 sequences = 3 draft rows, the first-ranked sequence takes them all
    assert [(i.seq, i.num_new_tokens, i.draft) for i in out.scheduled] == [
        (seqs[1], 1, ()), (seqs[0], 4, (7, 8, 9))]
    assert out.num_decodes == 1 and out.num_batched_tokens == 5
    assert len(seqs[0].block_ids) == 3  # positions 6..9
    sched.update(out, {seqs[0].seq_id: 11, seqs[1].seq_id: 12})
    assert [s.num_computed_tokens for s in seqs] == [7, 7]
    assert seqs[0].output_token_ids == [1, 11]
    sched.accept_draft_token(seqs[0], 12)  # 11 (the draft's 7's slot) was kept
    assert (seqs[0].num_computed_tokens, seqs[0].output_token_ids) == (8, [1, 11, 12])
    with pytest.raises(AssertionError, match="before its predecessor was read back"):
        seqs[0].num_computed_tokens -= 1
        sched.accept_draft_token(seqs[0], 13)
    seqs[0].num_computed_tokens += 1
    sched.check_integrity()
    # the budget: 2 decodes and 1 draft token in 3
    out = sched.schedule(3, propose=lambda s: (7, 8, 9, 10))
    assert [i.draft for i in out.scheduled] == [(), (7,)]
    # the blocks: 3 of 4 tokens, a sequence of 7 + 1 tokens holds 2; a draft of 6 would
    # need 2 more, so it is cut to the 4 the free block holds
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                      max_model_len=12, block_size=4), bm)
    (seq,) = _decoding(sched, ids, 1, 7)
    out = sched.schedule(propose=lambda s: (7, 8, 9, 10, 11, 12))
    assert [i.draft for i in out.scheduled] == [(7, 8, 9, 10)] and not out.preempted
    assert bm.num_free_blocks == 0
    sched.check_integrity()
    # --long-prefill-token-threshold 3 counts the draft in the chunk, as vLLM does: 1 + 2
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                      max_model_len=32, block_size=4,
                                      long_prefill_token_threshold=3),
                      BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True))
    _decoding(sched, ids, 1, 3)
    out = sched.schedule(propose=lambda s: (7, 8, 9, 10))
    assert [(i.num_new_tokens, i.draft) for i in out.scheduled] == [(3, (7, 8))]


def test_drafted_decodes_come_before_prefill_chunks():
    """A drafted decode is listed after the plain decodes and before every prefill chunk,
    even one ranked before it (a higher-priority prompt still being prefilled), so the
    plan serves its positions as decodes (``StepPlan.build``)."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8,
                                      max_model_len=32, block_size=4, policy="priority"), bm)
    ids = itertools.count()
    late = Sequence(next(ids), "late", 0, [0, 1, 2],
                    SamplingParams(temperature=0, max_tokens=50, priority=1))
    sched.add(late)
    sched.update(sched.schedule(), {late.seq_id: 1})  # first in: prefilled, decoding
    first = Sequence(next(ids), "p", 0, list(range(10)),
                     SamplingParams(temperature=0, max_tokens=5, priority=0))
    sched.add(first)
    out = sched.schedule(propose=lambda s: ())  # late decodes, first takes 7 of its 10
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(late, 1), (first, 7)]
    sched.update(out, {late.seq_id: 5})
    # first (ranked first) finishes its prompt with 3 tokens; late's draft takes the
    # budget's other 4
    out = sched.schedule(propose=lambda s: (7, 8, 9, 10) if s is late else ())
    assert [(i.seq, i.num_new_tokens, i.draft) for i in out.scheduled] == [
        (late, 5, (7, 8, 9, 10)), (first, 3, ())]
    assert out.num_decodes == 0
    sched.check_integrity()


# ------------------------------------------------------------------------- engine


def _never_paused() -> DraftBackoff:
    """A backoff whose probes always pass: for tests of what drafts keep."""
    return DraftBackoff(min_kept=0.0)


def _run(tiny_llama, tokenizer, prompts, params, speculative, **core):
    """Every request to the end; with ``speculative``, drafting is never paused (these
    tests check what drafts keep, whatever a probe would judge) unless ``core`` gives a
    ``draft_backoff``."""
    if speculative is not None:
        core.setdefault("draft_backoff", _never_paused())
    engine = make_core(tiny_llama, tokenizer, speculative=speculative, **core)
    outs = [submit(engine, f"r{i}", p, params[i] if isinstance(params, list) else params)
            for i, p in enumerate(prompts)]
    steps = run_to_end(engine)
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    return engine, outs, steps


class _LogProb(float):
    """A log-probability equal to another within ``1e-4``: a drafted position is computed
    in a step of another shape (more rows in every product), whose float32 sums may differ
    from a plain step's in the last bits (rounding both to 4 decimals instead split
    -5.13585 one way and the other on one machine). Token ids, texts and reasons still
    compare exactly."""

    def __eq__(self, other):
        return abs(self - other) <= 1e-4

    def __ne__(self, other):
        return not self == other

    __hash__ = float.__hash__


def _answers(outs, n: int = 1):
    """Per request and sibling: tokens, text, finish and stop reasons, logprobs (each a
    ``_LogProb``)."""
    got = []
    for o in outs:
        for i in range(n):
            deltas = [d for x in o for d in x.deltas if d.index == i]
            logprobs = [(lp.token_id, _LogProb(lp.logprob),
                         tuple((t, _LogProb(v)) for t, _, v in lp.top))
                        for d in deltas for lp in d.logprobs or ()]
            got.append((tokens_of(o, i), "".join(d.text for d in deltas),
                        deltas[-1].finish_reason, deltas[-1].stop_reason, logprobs))
    return got


@pytest.mark.parametrize("async_base", [True, False])
def test_greedy_tokens_are_those_without_speculation_in_fewer_steps(
        tiny_llama, smollm2_tokenizer, async_base):
    """Greedy requests (a 16-sequence step: room for drafts): the same tokens as the engine
    without speculation (asynchronous or not), in fewer steps; drafts were kept and
    rejected."""
    prompts = _prompts(6, 0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, base, base_steps = _run(tiny_llama, smollm2_tokenizer, prompts, params, None,
                               num_blocks=60, max_seqs=16, async_scheduling=async_base)
    engine, spec, steps = _run(tiny_llama, smollm2_tokenizer, prompts, params, SPEC,
                               num_blocks=60, max_seqs=16)
    assert _answers(spec) == _answers(base)
    assert all(o[-1].num_output_tokens == 40 for o in spec)
    c = engine.stats()
    assert c["generation_tokens_total"] == 6 * 40
    assert 0 < c["spec_decode_num_accepted_tokens_total"] < c[
        "spec_decode_num_draft_tokens_total"]
    assert c["spec_decode_num_drafts_total"] > 0
    assert steps < base_steps


SAMPLING = {
    "logprobs": dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
    "penalties": dict(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.05,
                      frequency_penalty=0.05, presence_penalty=0.05),
    "top_k_1": dict(temperature=0.9, top_k=1, max_tokens=30, ignore_eos=True),
    "min_tokens_eos": dict(temperature=0, max_tokens=30, min_tokens=12),
    "bias_and_bad_words": dict(temperature=0, max_tokens=30, ignore_eos=True,
                               logit_bias=((40, 3.0), (130, -5.0)),
                               bad_words_token_ids=((254, 148),)),
    "n_2": dict(temperature=0, max_tokens=30, ignore_eos=True, n=2),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_every_sampling_option_keeps_its_answer(tiny_llama, smollm2_tokenizer, name):
    """Each row of a draft is sampled under the history extended by the draft before it:
    log-probabilities (and their top alternatives), penalties over the output, min_tokens'
    EOS mask, logit bias and bad words, a random row whose filter leaves one token, and
    n = 2 siblings give exactly the answers they give without speculation, with drafts
    kept."""
    kw = dict(SAMPLING[name])
    prompts = _prompts(4, 1)
    eos = None
    if name == "min_tokens_eos":  # an EOS the greedy output reaches (after min_tokens)
        _, plain, _ = _run(tiny_llama, smollm2_tokenizer, prompts,
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           None, num_blocks=60, max_seqs=16)
        eos = tokens_of(plain[0])[20]
        kw["stop_token_ids"] = (eos,)
    params = SamplingParams(**kw)
    n = params.n
    _, base, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, None, num_blocks=60,
                      max_seqs=16)
    engine, spec, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, SPEC,
                           num_blocks=60, max_seqs=16)
    assert _answers(spec, n) == _answers(base, n)
    assert engine.drafting.counters["spec_decode_num_accepted_tokens_total"] > 0
    if eos is not None:
        first = _answers(spec)[0]
        assert first[2] == "stop" and first[3] == eos and len(first[0]) >= 12


def test_stop_strings_and_length_end_where_they_do_without_speculation(
        tiny_llama, smollm2_tokenizer):
    """Stop strings, ``max_tokens`` and the model's length end a sequence at the same
    token as without speculation (drafts never run past the last two)."""
    prompts = _prompts(4, 2)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, base, _ = _run(tiny_llama, smollm2_tokenizer, prompts, plain, None, num_blocks=60,
                      max_seqs=16)
    texts = [a[1] for a in _answers(base)]
    stops = [t[len(t) // 2:len(t) // 2 + 3] for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(s,))
              for s in stops]
    params[2] = plain  # of 256 tokens, 240 are the prompt's: the model's length ends it
    params[3] = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    long_prompt = (prompts[2] * 20)[:240]
    runs = []
    for spec in (None, SPEC):
        engine, outs, _ = _run(tiny_llama, smollm2_tokenizer, prompts[:2] + [long_prompt]
                               + prompts[3:], params, spec, num_blocks=60, max_seqs=16)
        runs.append(_answers(outs))
    assert runs[1] == runs[0]
    assert [a[2] for a in runs[1]] == ["stop", "stop", "length", "length"]
    assert [a[3] for a in runs[1][:2]] == stops[:2]
    assert runs[1][3][0] == tokens_of(base[3])[:13] and len(runs[1][2][0]) == 16
    assert engine.drafting.counters["spec_decode_num_accepted_tokens_total"] > 0


COUNTING = "one two three four five six seven eight nine ten, " * 2 + "one two three four"


def test_a_stop_string_inside_a_kept_draft_drops_the_tokens_after_it(
        smollm2_path, smollm2_tokenizer):
    """SmolLM2 continues a count its prompt holds twice: after the prefill's " five" the
    draft " six seven eight nine" is kept whole; the stop string " eight" is completed by
    a kept draft token, so the text ends before it and the tokens kept after it are
    dropped. Text, tokens, finish and stop reason equal the engine's without speculation,
    in fewer steps."""
    prompt = smollm2_tokenizer(COUNTING)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=12, stop=(" eight",))
    runs = []
    for spec in (None, SPEC):
        runner = ModelRunner(RunnerConfig(model=str(smollm2_path), kv_cache_memory=32 << 20),
                             LIMITS, TPGroup(0, 1, CPU, None))
        engine = EngineCore(runner, smollm2_tokenizer, SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=16),
            EngineConfig(check_integrity=True, speculative=spec))
        outs = submit(engine, "count", prompt, params)
        steps = run_to_end(engine)
        runs.append((_answers([outs]), steps, outs))
    (base, base_steps, _), (spec, steps, outs) = runs
    assert spec == base
    tokens, text, finish, reason, _ = spec[0]
    assert (text, finish, reason) == (" five six seven", "stop", " eight")
    assert smollm2_tokenizer.decode(tokens) == " five six seven eight"
    assert [len(d.token_ids) for x in outs for d in x.deltas] == [1, 3]
    assert steps < base_steps
    assert engine.drafting.counters["spec_decode_num_accepted_tokens_total"] >= 2


def test_preemption_and_prefix_hits_keep_every_token(tiny_llama, smollm2_tokenizer):
    """A pool too small for every sequence (preemption by recompute, drafts cut to the free
    blocks) and a second wave whose prompts are the first wave's prompts and answers
    (prefix-cache hits on blocks the drafts' steps computed): the tokens without
    speculation. Only kept tokens' blocks are cached: a hit on a rejected draft's K/V
    would change the second wave's tokens."""
    prompts = _prompts(6, 3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = []
    for spec in (None, SPEC):
        engine = make_core(tiny_llama, smollm2_tokenizer, num_blocks=18, max_seqs=16,
                           speculative=spec, draft_backoff=_never_paused())
        outs = [submit(engine, f"a{i}", p, params) for i, p in enumerate(prompts)]
        run_to_end(engine)
        second = [p + tokens_of(o) for p, o in zip(prompts, outs, strict=True)]
        outs2 = [submit(engine, f"b{i}", p, params) for i, p in enumerate(second)]
        run_to_end(engine)
        assert engine.counters["num_preemptions_total"] > 0
        hits = engine.scheduler.counters["prefix_cache_hits_total"]
        assert hits + engine.scheduler.preempted_lookups["hits"] > 0  # re-admissions' too
        results.append((_answers(outs), _answers(outs2)))
    assert results[1] == results[0]
    assert engine.drafting.counters["spec_decode_num_accepted_tokens_total"] > 0


def test_seeded_sampling_draws_as_without_speculation(tiny_llama, smollm2_tokenizer):
    """A seeded random request gets no draft (its draws per kept token stay one), so its
    tokens are those without speculation; an unseeded random one beside it is drafted."""
    prompts = _prompts(2, 4)
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    _, base, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, None, num_blocks=60,
                      max_seqs=16)
    engine, spec, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, SPEC,
                           num_blocks=60, max_seqs=16)
    assert _answers(spec) == _answers(base)
    assert engine.drafting.counters["spec_decode_num_drafts_total"] > 0
    engine, alone, _ = _run(tiny_llama, smollm2_tokenizer, prompts[:1], params[:1], SPEC,
                            num_blocks=60, max_seqs=16)
    assert _answers(alone) == _answers(base)[:1]
    assert engine.drafting.counters["spec_decode_num_drafts_total"] == 0


def test_above_disable_by_batch_size_nothing_is_drafted(tiny_llama, smollm2_tokenizer):
    """vLLM's ``disable_by_batch_size``: while more sequences run than it, no sequence is
    asked for a draft and steps overlap (a decode's input is the pending sample); as the
    shorter requests finish, the rest draft. Every answer is the one without speculation."""
    prompts = _prompts(6, 5)
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True)
              for i in range(6)]
    _, base, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, None, num_blocks=60,
                      max_seqs=16)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3,
                             prompt_lookup_min=1, disable_by_batch_size=2)
    engine = make_core(tiny_llama, smollm2_tokenizer, num_blocks=60, max_seqs=16,
                       speculative=spec, draft_backoff=_never_paused())
    asked, pending = [], []
    draft, plan = engine._draft, engine.runner.upload

    def recording_draft(seq):
        asked.append(engine.scheduler.num_running)
        return draft(seq)

    def recording_upload(p):
        pending.append(p.pending_rows.shape[0])
        return plan(p)

    engine._draft, engine.runner.upload = recording_draft, recording_upload
    outs = [submit(engine, f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    run_to_end(engine)
    assert _answers(outs) == _answers(base)
    assert asked and max(asked) <= 2
    assert engine.drafting.counters["spec_decode_num_accepted_tokens_total"] > 0
    assert max(pending) > 0  # steps overlapped while six or more ran
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_the_backoff_pauses_drafting_where_it_keeps_too_little():
    """``DraftBackoff``: a probe of ``window`` drafting steps (or fewer, once they sampled
    ``window_sequences`` sequence-steps) keeping fewer than ``min_kept`` tokens a sampled
    sequence-step pauses drafting, for ``first_pause`` steps, doubling with each failed
    probe in a row up to ``max_pause``; a probe that keeps enough resets it; steps that
    could not draft for another reason count for neither the probe nor the pause."""
    b = DraftBackoff(window=2, window_sequences=4, min_kept=0.5, first_pause=3,
                     max_pause=8)
    pauses = []
    for kept in ([1, 0], [0, 0], [0, 0], [0, 0], [1, 1], [0, 0]):  # of 2 sequences a step
        assert b.probing
        b.record(False, 2, 0)  # e.g. above disable_by_batch_size: nothing
        for k in kept:
            assert b.probing
            b.record(True, 2, k)
        pauses.append(b.paused_for)
        for _ in range(b.paused_for):
            assert not b.probing
            b.record(False, 2, 0)
    # 1 of 4 sequence-steps kept (0.25 < 0.5): 3; then 6, 8 (the cap), 8; 2 of 4 passes
    # and resets the next failure's to 3
    assert pauses == [3, 6, 8, 8, 0, 3]
    assert b.probes_failed == 5
    # 5 sequences a step: one step reaches window_sequences and is judged alone
    for _ in range(b.paused_for):
        b.record(False, 5, 0)
    b.record(True, 5, 2)  # 0.4 < 0.5
    assert b.paused_for == 6 and b.probes_failed == 6
    with pytest.raises(ValueError, match="bad draft backoff"):
        DraftBackoff(first_pause=0)


def test_drafting_counts_what_drafts_keep_and_judges_each_step_by_its_own():
    """``Drafting``: vLLM's counters and the per-position counts from each verified draft;
    a step hands the backoff the tokens kept since the step before, so a probe is judged
    by its own steps; paused steps are counted; ``disable_by_batch_size`` bounds drafting
    apart from the backoff."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2,
                             prompt_lookup_min=1, disable_by_batch_size=4)
    d = Drafting(spec, DraftBackoff(window=1, window_sequences=8, min_kept=1,
                                    first_pause=2, max_pause=2))
    assert d.may_draft(4) and not d.may_draft(5)
    d.record(3, 2)
    d.record(2, 0)
    d.end_step(True, 2)  # 2 kept of 2 sequences: passes
    assert d.may_draft(1)
    d.record(3, 3)
    d.end_step(True, 4)  # 3 of 4: fails, although 5 were kept over both steps
    assert not d.may_draft(1)
    d.end_step(False, 4)
    d.end_step(False, 4)
    assert d.may_draft(1)
    assert d.stats() == {"spec_decode_num_drafts_total": 3,
                         "spec_decode_num_draft_tokens_total": 8,
                         "spec_decode_num_accepted_tokens_total": 5,
                         "spec_decode_paused_steps_total": 2,
                         "spec_decode_num_accepted_tokens_per_pos": [2, 2, 1]}


def test_paused_drafting_overlaps_steps_and_keeps_every_answer(tiny_llama,
                                                              smollm2_tokenizer):
    """An engine whose probes always fail (``min_kept`` above any step's gain) drafts in
    its probes only; in the pauses its steps overlap again (a decode's input is the
    pending sample) and count as paused; every answer is the one without speculation."""
    prompts = _prompts(4, 5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, base, _ = _run(tiny_llama, smollm2_tokenizer, prompts, params, None, num_blocks=60,
                      max_seqs=16)
    engine = make_core(tiny_llama, smollm2_tokenizer, num_blocks=60, max_seqs=16,
                       speculative=SPEC, draft_backoff=DraftBackoff(
                           window=3, min_kept=100.0, first_pause=5, max_pause=5))
    pending, plan = [], engine.runner.upload

    def recording_upload(p):
        pending.append(p.pending_rows.shape[0])
        return plan(p)

    engine.runner.upload = recording_upload
    outs = [submit(engine, f"r{i}", p, params) for i, p in enumerate(prompts)]
    run_to_end(engine)
    assert _answers(outs) == _answers(base)
    c = engine.stats()
    assert c["spec_decode_num_drafts_total"] > 0 and engine.drafting.backoff.probes_failed >= 3
    # after the prefill step, probes of 3 steps and pauses of 5 alternate
    assert c["spec_decode_paused_steps_total"] >= 5 * (engine.drafting.backoff.probes_failed - 1)
    assert max(pending) > 0  # paused steps overlapped
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def _top2(model, comm, ids: list[int]) -> dict[int, float]:
    """The next token's distribution at temperature 1 under top_k 2 (float64)."""
    logits = full_logits(model, comm, ids)[-1].double()
    top = logits.topk(2)
    return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist(), strict=True))


def test_sampled_tokens_keep_their_distribution(tiny_llama, smollm2_tokenizer):
    """Random sampling (temperature 1, top_k 2, three tokens, unseeded: drafted): after the
    prefill's token, a one-token draft from the prompt is verified, kept with its
    probability, else replaced by the token sampled instead. Over 400 requests the
    frequency of every three-token answer is the model's probability of it, within 4.5
    standard errors: the draft neither adds weight to its token nor takes it away. The
    prompt is chosen so that both first tokens draft, and one draft is a token the model
    may sample next (kept sometimes, rejected sometimes)."""
    model, comm = load(tiny_llama)
    rng = random.Random(7)
    while True:
        prompt = [rng.randrange(256) for _ in range(120)]
        first = _top2(model, comm, prompt)
        drafts = {t: lookup_draft(prompt + [t], 1, 1, 1) for t in first}
        second = {t: _top2(model, comm, prompt + [t]) for t in first}
        if all(drafts.values()) and any(drafts[t][0] in second[t] for t in first):
            break
    want = {(a, b, c): first[a] * second[a][b] * pc
            for a in first for b in second[a]
            for c, pc in _top2(model, comm, prompt + [a, b]).items()}
    one = SpeculativeConfig(num_speculative_tokens=1, prompt_lookup_max=1,
                            prompt_lookup_min=1)
    engine = make_core(tiny_llama, smollm2_tokenizer, num_blocks=200, max_seqs=256,
                       budget=4096, speculative=one, draft_backoff=_never_paused())
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
    counts: dict[tuple[int, ...], int] = {}
    for wave in range(4):  # 100 at a time: every decode has a spare row for its draft
        outs = [submit(engine, f"w{wave}-{i}", prompt, params) for i in range(100)]
        run_to_end(engine)
        for o in outs:
            key = tuple(tokens_of(o))
            counts[key] = counts.get(key, 0) + 1
    c = engine.stats()
    assert 0 < c["spec_decode_num_accepted_tokens_total"] < c[
        "spec_decode_num_draft_tokens_total"] <= 400
    assert set(counts) <= set(want)
    for answer, p in want.items():
        freq = counts.get(answer, 0) / 400
        assert abs(freq - p) <= 4.5 * (p * (1 - p) / 400) ** 0.5 + 1e-9, (answer, freq, p)


def test_one_seat_drafts_nothing_and_the_start_up_says_so(tiny_llama, smollm2_tokenizer,
                                                          caplog):
    """A step samples at most --max-num-seqs rows and drafts take the rows its sequences
    leave: with one, nothing is drafted (vLLM would draft), and the start-up log warns."""
    with caplog.at_level("WARNING", logger="tpserve.server.engine.engine_core"):
        engine = make_core(tiny_llama, smollm2_tokenizer, num_blocks=60, max_seqs=1,
                           speculative=SPEC, draft_backoff=_never_paused())
    assert [r.message for r in caplog.records if "--max-num-seqs 1" in r.message] == [
        "--speculative-config with --max-num-seqs 1: a step samples at most --max-num-seqs "
        "rows and drafts take the rows its sequences leave, so nothing is ever drafted; "
        "raise --max-num-seqs"]
    submit(engine, "a", _prompts(1, 4)[0], SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True))
    run_to_end(engine)
    assert engine.drafting.counters["spec_decode_num_drafts_total"] == 0
