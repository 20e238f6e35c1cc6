"""Beam search (``use_beam_search``, ``http/beam_search.py``) through a real ``tpserve serve``
of the embedded SmolLM2, driven by the real openai client, against a beam search written
here over transformers' float32 logits of the same model: the same beams, in the same
order, with the same finish reasons and summed log-probabilities; width 1 without EOS is
greedy decoding; streamed answers equal whole ones; refusals name their field; every
block is back in the pool afterwards."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from tests.server.beam_reference import reference
from tests.server.serverproc import SMALL, ServerProcess

ANSWER = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL, "--served-model-name", "smol")
    yield s
    assert s.stop() == 0, s.output()


def _beams(client, prompt: list[int], width: int, steps: int, **extra):
    answer = client.completions.create(
        model="smol", prompt=prompt, max_tokens=steps, n=width, logprobs=1,
        extra_body={"use_beam_search": True, "return_token_ids": True, **extra})
    assert [c.index for c in answer.choices] == list(range(width))
    assert answer.usage.completion_tokens == sum(len(c.token_ids) for c in answer.choices)
    return answer


@pytest.mark.parametrize("case", ["eos", "length_penalty", "story"])
def test_beams_equal_a_beam_search_over_transformers_logits(server, hf_smollm2, case):
    model, tok = hf_smollm2
    prompt, width, steps, penalty = {
        "eos": (ANSWER, 3, 14, 1.0),  # short answers: beams end with <|im_end|>
        "length_penalty": (ANSWER, 3, 14, 0.0),  # by sum alone: the shorter ends win
        "story": (STORY, 2, 10, 1.0),
    }[case]
    ids = tok(prompt).input_ids
    want = reference(model, ids, width, steps, {tok.eos_token_id}, penalty)
    extra = {} if penalty == 1.0 else {"length_penalty": penalty}
    answer = _beams(server.client(), ids, width, steps, **extra)
    got = [(tuple(c.token_ids), c.finish_reason) for c in answer.choices]
    assert got == [(tokens, reason) for tokens, _, reason in want]
    for choice, (tokens, total, _) in zip(answer.choices, want, strict=True):
        assert choice.text == tok.decode(tokens, skip_special_tokens=True)
        assert len(choice.logprobs.token_logprobs) == len(tokens)
        assert math.isclose(sum(choice.logprobs.token_logprobs), total, abs_tol=1e-3)
    if case != "story":  # the path where beams end is taken
        assert "stop" in [reason for _, _, reason in want]
    server.wait_pool_free()


def test_width_one_without_eos_is_greedy_and_a_stream_equals_the_whole(server, hf_smollm2):
    model, tok = hf_smollm2
    ids = tok(STORY).input_ids
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8)[0, len(ids):].tolist()
    client = server.client()
    one = _beams(client, ids, 1, 8, ignore_eos=True)
    assert one.choices[0].token_ids == greedy
    whole = _beams(client, ids, 2, 6)
    chunks = list(client.completions.create(
        model="smol", prompt=ids, max_tokens=6, n=2, stream=True,
        extra_body={"use_beam_search": True}))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole.choices}
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=14,
        n=3, extra_body={"use_beam_search": True})
    want = reference(model, tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True)["input_ids"],
        3, 14, {tok.eos_token_id})
    assert [c.message.content for c in chat.choices] == [
        tok.decode(tokens, skip_special_tokens=True) for tokens, _, _ in want]
    server.wait_pool_free()


def test_each_beam_step_is_one_engine_step(server):
    """A beam step's one-token requests leave the HTTP process in one message
    (``engine/front.TurnBatch``) and the engine admits them together: 4 beams over 8
    steps take 8 engine steps, not one more for each beam that arrived late."""
    before = server.metric("steps_total")
    answer = _beams(server.client(), STORY, 4, 8, ignore_eos=True)
    assert [len(c.token_ids) for c in answer.choices] == [8] * 4
    assert server.metric("steps_total") - before == 8
    server.wait_pool_free()


@pytest.mark.parametrize(("extra", "field"), [
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "top_p": 0.9}, "top_p"),
    ({"use_beam_search": True, "presence_penalty": 0.5}, "presence_penalty"),
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_refused(server, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model="smol", prompt=STORY, max_tokens=4,
                                           extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == field, err.value.body
