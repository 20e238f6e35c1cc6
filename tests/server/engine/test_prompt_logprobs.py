"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, the completions API's
``echo`` with ``logprobs``) through EngineCore on CPU with the tiny Llama: every prompt
token after the first gets transformers' log-softmax at the position before it, and its
top alternatives in order, and its rank, whether the prompt is prefilled in one step or in chunks
(asynchronous scheduling, prefix-cache hits available but not taken for scoring, siblings,
preemption); the pool is free at the end."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_tiny_models import _hf_model
from tests.server.engine.test_engine_core import make_core, run_to_end, submit, tokens_of
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.outputs import TokenLogprob
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.sequence import Sequence

PROMPT = [5, 17, 200, 45, 9, 88, 131, 7, 250, 64, 1, 99, 12, 33, 71, 140, 2, 60, 61, 8,
          19, 230, 111, 4, 90, 45, 45, 3, 18, 200, 77, 150, 6, 42, 13, 240, 100, 25, 11, 70]


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 log-softmax at every prompt position (the tiny Llama's
    weights, as the ``tiny_llama`` folder holds them)."""
    with torch.no_grad():
        return torch.log_softmax(_hf_model("llama")(torch.tensor([PROMPT])).logits[0], -1)


def _check(scored, reference, top: int) -> None:
    assert [e.token_id for e in scored] == PROMPT[1:]
    for i, e in enumerate(scored):
        ref = reference[i]
        assert abs(e.logprob - ref[PROMPT[i + 1]].item()) < 1e-4, i
        assert e.rank == int((ref > ref[PROMPT[i + 1]]).sum()) + 1, i
        want = ref.topk(top)
        assert [t for t, _, _ in e.top] == want.indices.tolist(), i
        assert max(abs(lp - w) for (_, _, lp), w in zip(e.top, want.values.tolist(), strict=True)) < 1e-4


@pytest.mark.parametrize("budget", [64, 16, 7])
def test_prompt_logprobs_equal_transformers(tiny_llama, smollm2_tokenizer, reference, budget):
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=40, budget=budget)
    plain = submit(core, "warm", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    run_to_end(core)  # the prompt's full blocks are now in the prefix cache
    outs = submit(core, "x", PROMPT, SamplingParams(temperature=0, max_tokens=3, n=2,
                                                      prompt_logprobs=3, ignore_eos=True))
    run_to_end(core)
    firsts = [next(d for o in outs for d in o.deltas if d.index == i) for i in (0, 1)]
    _check(firsts[0].prompt_logprobs, reference, 3)
    assert firsts[1].prompt_logprobs == firsts[0].prompt_logprobs
    later = [d for o in outs for d in o.deltas if d not in firsts]
    assert later and all(d.prompt_logprobs is None for d in later)
    assert outs[-1].num_cached_tokens == 0  # scoring computed every position itself
    assert tokens_of(outs, 0) == tokens_of(outs, 1) == tokens_of(plain, 0)
    assert core.block_manager.num_used_blocks == 0


def test_preemption_leaves_the_scored_prompt_whole(tiny_llama, smollm2_tokenizer,
                                                             reference):
    """Two long scored requests in a pool too small for both: preemption by recompute
    happens, and each request's first delta still holds its prompt's entries once each,
    in order."""
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=16, budget=16)
    a = submit(core, "a", PROMPT, SamplingParams(temperature=0, max_tokens=100,
                                                 ignore_eos=True, prompt_logprobs=1))
    b = submit(core, "b", PROMPT, SamplingParams(temperature=0, max_tokens=100,
                                                 ignore_eos=True, prompt_logprobs=1))
    run_to_end(core)
    assert core.counters["num_preemptions_total"] > 0
    for outs in (a, b):
        _check(outs[0].deltas[0].prompt_logprobs, reference, 1)
    assert core.block_manager.num_used_blocks == 0


def test_a_one_token_prompt_has_nothing_to_score(tiny_llama, smollm2_tokenizer):
    core = make_core(tiny_llama, smollm2_tokenizer, num_blocks=16)
    outs = submit(core, "x", [5], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=0))
    run_to_end(core)
    assert outs[0].deltas[0].prompt_logprobs == ()


def test_entries_already_held_are_not_added_again():
    """A sequence preempted while scoring recomputes from position 0: its repeated entries
    are skipped, the new ones appended, and scoring ends once every token is held."""
    state = RequestState("r", [1, 2, 3, 4, 5, 6], SamplingParams(prompt_logprobs=0),
                         lambda out: None)
    state.seqs.append(Sequence(0, "r", 0, [1, 2, 3, 4, 5, 6], state.params))

    def entries(start, stop, tag):
        return [TokenLogprob(p + 2, "", float(tag)) for p in range(start, stop)]

    state.add_prompt_logprobs(0, entries(0, 3, -1))
    assert state.seqs[0].scores_prompt
    state.add_prompt_logprobs(0, entries(0, 4, -2))  # recomputed from 0: only position 3 new
    assert [e.logprob for e in state.prompt_logprobs] == [-1, -1, -1, -2]
    state.add_prompt_logprobs(4, entries(4, 5, -3))
    assert [e.token_id for e in state.scored_prompt()] == [2, 3, 4, 5, 6]
    assert not state.seqs[0].scores_prompt


def test_prompt_token_texts_spell_a_prompt_of_split_characters(tiny_llama, smollm2_tokenizer):
    """Each scored token's text is read at its prompt position (``TokenTexts``, as vLLM
    corrects prompt logprobs after the prompt tokens before them). A prompt of single-byte
    tokens (SmolLM2's byte tokens lie within the tiny Llama's 256 ids) holding multi-byte
    characters, scored in chunks: a byte that only starts a character reads "", the one that
    completes it the whole character, so the texts spell the prompt past its first token;
    an alternative byte outside ASCII reads "" or the character it completes there."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = smollm2_tokenizer
    text = "Party 🎉 time: 中文, é!"
    char_of = bytes_to_unicode()
    byte_of = {tok.convert_tokens_to_ids(c): b for b, c in char_of.items()}
    prompt = [tok.convert_tokens_to_ids(char_of[b]) for b in text.encode()]
    assert max(prompt) < 256 and tok.decode(prompt) == text
    core = make_core(tiny_llama, tok, num_blocks=40, budget=7)
    outs = submit(core, "x", prompt, SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=5))
    run_to_end(core)
    scored = outs[0].deltas[0].prompt_logprobs
    assert [e.token_id for e in scored] == prompt[1:]
    assert [e.text for e in scored][5:9] == ["", "", "", "🎉"]
    assert "".join(e.text for e in scored) == text[1:]
    alternatives = [(t, alt) for e in scored for t, alt, _ in e.top]
    # some alternative bytes complete a character there (🎕 for 🎉's last byte, 丒 ...)
    assert any(alt and t in byte_of and byte_of[t] >= 0x80 for t, alt in alternatives)
    for t, alt in alternatives:
        assert not alt.endswith("\ufffd")
        if t in byte_of and byte_of[t] >= 0x80:
            assert alt == "" or (len(alt) == 1 and alt.encode()[-1] == byte_of[t]), (t, alt)
