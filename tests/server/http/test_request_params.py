"""The model's sampling defaults fill only what a request omits."""

from __future__ import annotations

import pytest

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, CompletionRequest
from tpserve.server.http.request_params import build_sampling_params

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 128}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_defaults_fill_omitted_fields():
    p = build_sampling_params(chat(), 10, 4096, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.9, 20, 0.05, 1.1, 128)
    # completions: at most 16 unless asked (OpenAI's and vLLM's default there)
    assert build_sampling_params(completion(), 10, 4096, DEFAULTS).max_tokens == 16
    assert build_sampling_params(completion(max_tokens=None), 10, 4096,
                                 DEFAULTS).max_tokens == 128


def test_request_values_win():
    p = build_sampling_params(completion(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                         repetition_penalty=1.0, max_tokens=7),
                              10, 4096, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        1.0, 1.0, 0, 0.0, 1.0, 7)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 max_completion_tokens=9, temperature=0)
    p = build_sampling_params(chat, 10, 4096, DEFAULTS)
    assert (p.max_tokens, p.temperature, p.top_k) == (9, 0.0, 20)


def test_without_defaults_openai_defaults_apply():
    """OpenAI's and vLLM's defaults: a completion of 16 tokens at most (an explicit null:
    the room the prompt leaves), a chat answer up to the room."""
    p = build_sampling_params(completion(), 10, 4096, {})
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 16)
    assert build_sampling_params(completion(), 10, 4096) == p
    assert build_sampling_params(completion(), 4090, 4096).max_tokens == 6  # the room
    assert build_sampling_params(completion(max_tokens=None), 10, 4096).max_tokens == 4086
    assert build_sampling_params(chat(), 10, 4096).max_tokens == 4086


def test_a_default_max_tokens_is_cut_to_the_room_left():
    assert build_sampling_params(chat(), 4000, 4096, DEFAULTS).max_tokens == 96
    with pytest.raises(APIError, match="maximum context length is 4096"):
        build_sampling_params(completion(max_tokens=128), 4000, 4096, DEFAULTS)


def test_bad_words_are_each_form_once_in_order(smollm2_tokenizer):
    """vLLM's bad_words: each word as sent and with one leading space, without special
    tokens; a sequence two words give is kept once, where it first came (a dict, not a
    list scanned per word: 20,000 words took 17 s of the event loop)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from tpserve.server.http.prompts import PromptProcessor
    from tpserve.server.http.request_params import bad_words_token_ids

    def encode(text: str) -> tuple[int, ...]:
        return tuple(smollm2_tokenizer.encode(text, add_special_tokens=False))

    with ThreadPoolExecutor(1) as executor:
        prompts = PromptProcessor(smollm2_tokenizer, executor)
        got = asyncio.run(bad_words_token_ids(["cat", " cat", "dog"] * 3, prompts))
        assert got == (encode("cat"), encode(" cat"), encode("dog"), encode(" dog"))
        words = [f"w{i}" for i in range(2_000)]
        assert set(asyncio.run(bad_words_token_ids(words, prompts))) == {
            encode(form) for w in words for form in (w, " " + w)}
        with pytest.raises(APIError, match="empty words"):
            asyncio.run(bad_words_token_ids(["x", " "], prompts))
