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


def test_defaults_fill_omitted_fields():
    p = build_sampling_params(completion(), 10, 4096, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.9, 20, 0.05, 1.1, 128)


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
    p = build_sampling_params(completion(), 10, 4096, {})
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 4086)
    assert build_sampling_params(completion(), 10, 4096) == p


def test_a_default_max_tokens_is_cut_to_the_room_left():
    assert build_sampling_params(completion(), 4000, 4096, DEFAULTS).max_tokens == 96
    with pytest.raises(APIError, match="maximum context length is 4096"):
        build_sampling_params(completion(max_tokens=128), 4000, 4096, DEFAULTS)
