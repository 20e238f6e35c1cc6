"""Beam search (``use_beam_search``, ``http/beam_search.py``) through a real ``tpserve serve``
of the embedded SmolLM2, driven by the real openai client, against a beam search written
here over transformers' float32 logits of the same model: the same beams, in the same
order, with the same finish reasons and summed log-probabilities; width 1 without EOS is
greedy decoding; streamed answers equal whole ones; refusals name their field; every
block is back in the pool afterwards."""

from __future__ import annotations

import json
import math
import signal
import threading

import httpx
import openai
import pytest
import torch

from tests.server.beam_reference import reference
from tests.server.serverproc import SMALL, ServerProcess

ANSWER = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
STORY = "Once upon a time, in a small village by the sea,"
TWO = [19556, 30]  # "Hello", "."
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]


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
    ({"use_beam_search": True, "guided_choice": ["a", "b"]}, "guided_choice"),
    ({"use_beam_search": True, "structured_outputs": {"regex": "[ab]"}},
     "structured_outputs.regex"),
    ({"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"use_beam_search": True, "echo": True, "logprobs": 1}, "echo"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_refused(server, extra, field):
    """The field named is one the request sent (echo with logprobs scores the prompt, but
    the request sent no prompt_logprobs)."""
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model="smol", prompt=STORY, max_tokens=4,
                                           extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == field, err.value.body


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema.schema"),
])
def test_a_chat_refusal_names_the_constraint_the_request_sent(server, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
            extra_body={"use_beam_search": True, **extra})
    assert err.value.body["param"] == field, err.value.body


def test_an_ending_stop_token_adds_its_text_only_with_include_stop_str_in_output(server):
    """As the engine's stop rules: a stop_token_ids entry or EOS that ends a beam stays in
    its token ids and logprobs, and adds its text only with include_stop_str_in_output,
    also where skip_special_tokens false would show EOS."""
    client = server.client()
    for include in (False, True):
        extra = {"stop_token_ids": [30], "include_stop_str_in_output": include,
                 "return_token_ids": True}
        plain, beam = (client.completions.create(
            model="smol", prompt=ANSWER, max_tokens=14, n=1, logprobs=1, temperature=0,
            extra_body={**extra, **more}).choices[0]
            for more in ({}, {"use_beam_search": True}))
        assert beam.text == plain.text == "I'm so glad you're here" + "." * include
        assert beam.token_ids == plain.token_ids and beam.token_ids[-1] == 30
        assert (beam.finish_reason, beam.stop_reason) == ("stop", 30)
        assert beam.logprobs.tokens == plain.logprobs.tokens
        assert beam.logprobs.tokens[-1] == "." and beam.logprobs.text_offset == \
            plain.logprobs.text_offset
    eos = "<|im_end|>"
    for include in (False, True):
        extra = {"use_beam_search": True, "skip_special_tokens": False,
                 "include_stop_str_in_output": include, "return_token_ids": True}
        completion = client.completions.create(model="smol", prompt=ANSWER, max_tokens=14,
                                               n=3, extra_body=extra).choices[0]
        assert (completion.text, completion.finish_reason, completion.token_ids) == (
            "Hello." + eos * include, "stop", [19556, 30, 2])
        chat = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content":
                                     "What is 2+2? Answer with one number only."}],
            max_tokens=10, n=3, extra_body=extra).choices
        assert [(c.message.content, c.finish_reason, c.token_ids[-1]) for c in chat] == [
            (text + eos * include, "stop", 2)
            for text in ("2 + 2 = 4", "The answer is 4.", "The answer is 4")]
    server.wait_pool_free()


def _streamed(server, path: str, body: dict) -> dict[int, tuple[str, str | None, bool]]:
    """Each streamed choice's (text, finish reason, whether a role chunk came)."""
    got: dict[int, tuple[str, str | None, bool]] = {}
    with httpx.stream("POST", server.base + path, timeout=600,
                      json={"model": "smol", "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text, reason, role = got.get(c["index"], ("", None, False))
                delta = c.get("delta", {})
                got[c["index"]] = (text + (c.get("text") or delta.get("content") or ""),
                                   reason or c["finish_reason"],
                                   role or delta.get("role") == "assistant")
    return got


def test_a_search_that_finds_fewer_beams_than_n_answers_the_beams_found(server):
    """Two allowed tokens, one step: two beams a prompt whatever n says; the answer holds
    those two (as vLLM's), whole and streamed; a multi-prompt completion keeps choice k*n+i
    for beam i of prompt k."""
    client = server.client()
    extra = {"use_beam_search": True, "allowed_token_ids": TWO}
    whole = client.completions.create(model="smol", prompt=[ANSWER, STORY], max_tokens=1,
                                      n=3, extra_body=extra)
    want = [(0, "Hello", "length"), (1, ".", "length"), (3, ".", "length"),
            (4, "Hello", "length")]
    assert [(c.index, c.text, c.finish_reason) for c in whole.choices] == want
    assert whole.usage.completion_tokens == 4
    assert _streamed(server, "/v1/completions", {
        "prompt": [ANSWER, STORY], "max_tokens": 1, "n": 3, **extra}) == {
        i: (text, reason, False) for i, text, reason in want}
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="smol", messages=messages, max_tokens=1,
                                          n=4, extra_body=extra)
    assert [(c.index, c.finish_reason) for c in chat.choices] == [(0, "length"),
                                                                  (1, "length")]
    assert sorted(c.message.content for c in chat.choices) == [".", "Hello"]
    assert _streamed(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "n": 4, **extra}) == {
        c.index: (c.message.content, "length", True) for c in chat.choices}
    server.wait_pool_free()


def test_a_beam_search_in_flight_finishes_when_the_server_drains():
    """SIGTERM: a search in flight goes on to its answer as a plain request does (its
    steps are let in while the server drains), and a search sent after is refused."""
    s = ServerProcess(*SMALL, "--served-model-name", "smol")
    results: dict[str, tuple[int, dict]] = {}

    def go(name: str, body: dict) -> None:
        r = httpx.post(s.base + "/v1/completions", timeout=300, json={
            "model": "smol", "prompt": STORY, "ignore_eos": True, **body})
        results[name] = (r.status_code, r.json())

    try:
        before = s.metric("steps_total")
        threads = [threading.Thread(target=go, args=a) for a in (
            ("beam", {"max_tokens": 30, "n": 3, "use_beam_search": True,
                      "return_token_ids": True}),
            ("plain", {"max_tokens": 60, "n": 3}))]
        for t in threads:
            t.start()
        for _ in range(1200):  # a few steps in: both run
            if s.metric("steps_total") >= before + 3:
                break
            threading.Event().wait(0.05)
        s.proc.send_signal(signal.SIGTERM)
        go("late", {"max_tokens": 4, "n": 2, "use_beam_search": True})
        for t in threads:
            t.join(timeout=300)
        assert s.proc.wait(timeout=60) == 0
    finally:
        s.stop()
    assert results["late"][0] == 503
    assert results["plain"][0] == 200
    assert results["beam"][0] == 200, results["beam"]
    assert [(len(c["token_ids"]), c["finish_reason"])
            for c in results["beam"][1]["choices"]] == [(30, "length")] * 3
