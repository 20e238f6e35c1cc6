"""Turns an OpenAI request into ``SamplingParams`` and checks it against the context length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpserve.model.sampling_params import RepetitionDetection, SamplingParams
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.prompts import PromptProcessor
from tpserve.server.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# the fields a model's generation config may default (max_tokens is handled apart)
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# a completions request that leaves max_tokens out gets at most this many (OpenAI's legacy
# Completions and vLLM's default; chat's is the room the prompt leaves, as vLLM's)
COMPLETIONS_MAX_TOKENS = 16


def _max_tokens(req: SamplingRequest) -> tuple[int | None, str]:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def _logprobs(req: SamplingRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    assert isinstance(req, ChatCompletionRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chosen_logprob_tokens(req: SamplingRequest, vocab_size: int) -> tuple[int, ...] | None:
    """vLLM's ``logprob_token_ids``, each id once in the order first given; 400 for an
    empty list, more than vLLM's 128, ids outside the vocabulary, or a request that asks
    no logprobs."""
    if req.logprob_token_ids is None:
        return None
    ids = tuple(dict.fromkeys(req.logprob_token_ids))
    cap = SamplingParams.MAX_LOGPROB_TOKEN_IDS
    if not ids or len(ids) > cap or min(ids) < 0 or max(ids) >= vocab_size:
        raise APIError.bad_request(
            f"logprob_token_ids must list 1 to {cap} token ids in [0, {vocab_size})",
            "logprob_token_ids")
    completion = isinstance(req, CompletionRequest)
    if (req.logprobs is None) if completion else not req.logprobs:
        raise APIError.bad_request("logprob_token_ids needs logprobs" + (
            "" if completion else ": true"), "logprob_token_ids")
    return ids


def _repetition(req: SamplingRequest) -> RepetitionDetection | None:
    """vLLM's ``repetition_detection`` (None: not asked, or switched off by zero sizes);
    400 for sizes or a count it refuses."""
    asked = req.repetition_detection
    if asked is None or asked.max_pattern_size == asked.min_pattern_size == 0:
        return None
    try:
        return RepetitionDetection(asked.max_pattern_size, asked.min_pattern_size,
                                   asked.min_count)
    except ValueError as exc:
        raise APIError.bad_request(str(exc), "repetition_detection") from exc


def check_logprob_counts(req: SamplingRequest, limit: int) -> None:
    """400 for a request asking more logprobs than ``limit`` (``--max-logprobs``), naming
    the field in vLLM's words."""
    fields = {"prompt_logprobs": req.prompt_logprobs}
    if isinstance(req, CompletionRequest):
        fields["logprobs"] = req.logprobs
    else:
        assert isinstance(req, ChatCompletionRequest)
        fields["top_logprobs"] = req.top_logprobs
    for name, value in fields.items():
        if value is not None and value > limit:
            raise APIError.bad_request(
                f"Requested {name} of {value}, which is greater than max allowed: {limit}",
                name)


async def bad_words_token_ids(words: list[str] | None, prompts: PromptProcessor
                              ) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences: each word encoded as sent and with one
    leading space (how it reads mid-sentence), without special tokens, duplicates once;
    400 for an empty word."""
    # a dict: insertion order with a hash lookup (a list's scan was quadratic: 20,000
    # words took 17 s of the event loop)
    seqs: dict[tuple[int, ...], None] = {}
    for word in words or ():
        if not word.strip():
            raise APIError.bad_request("bad_words must not hold empty words", "bad_words")
        for form in (word, " " + word.lstrip()):
            ids = tuple(await prompts.encode(form, add_special_tokens=False))
            if ids:
                seqs.setdefault(ids)
    return tuple(seqs)


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int,
                     side: str | None = None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: its last
    ``max_model_len``), or its first with ``side`` "right" (vLLM's ``truncation_side``);
    None leaves it whole; 400 for other values."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise APIError.bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
                                   "truncate_prompt_tokens")
    if keep > max_model_len:  # as vLLM
        raise APIError.bad_request(f"truncate_prompt_tokens {keep} exceeds the model's context "
                                   f"({max_model_len} tokens)", "truncate_prompt_tokens")
    return ids[:keep] if side == "right" else ids[-keep:]


def build_sampling_params(req: SamplingRequest, prompt_len: int, max_model_len: int,
                          defaults: Mapping[str, float | int] | None = None,
                          constraints: dict[str, Any] | None = None,
                          max_logprobs: int = SamplingParams.MAX_LOGPROBS) -> SamplingParams:
    """Raises ``APIError`` 400 for invalid values, more logprobs than ``max_logprobs`` or
    prompt + max_tokens over the context.

    ``defaults`` (the model's generation config, by ``SamplingParams`` field) fill only
    the sampling fields the request omits; a default ``max_tokens`` is cut to the room
    the prompt leaves (and a completions request's to ``COMPLETIONS_MAX_TOKENS``, as
    vLLM's), while a requested one over the room is refused. ``constraints``
    (``logit_bias``, ``structured``) were validated by ``http/structured``."""
    defaults = defaults or {}
    max_tokens, max_tokens_field = _max_tokens(req)
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError.bad_request("prompt_logprobs is not available with stream",
                                   "prompt_logprobs")
    if req.stream_options is not None and req.stream_options.model_fields_set \
            and not req.stream:  # as vLLM (an empty object passes there too)
        raise APIError.bad_request("stream_options can only be given with stream true",
                                   "stream_options")
    check_logprob_counts(req, max_logprobs)
    asked = [v for v in (req.prompt_logprobs, req.logprobs if echo else None) if v is not None]
    if echo and max_tokens == 0:
        max_tokens = 1  # the prompt alone: one token is sampled and dropped (http/echo.py)
    room = max_model_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise APIError.bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt has {prompt_len} tokens, which leaves no room for the completion.",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        cap = int(defaults.get("max_tokens", room))
        if isinstance(req, CompletionRequest) and "max_tokens" not in req.model_fields_set:
            cap = min(cap, COMPLETIONS_MAX_TOKENS)  # left out (an explicit null: the room)
        max_tokens = min(room, cap)
    elif max_tokens > room and max_tokens >= 1:
        raise APIError.bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or {max_tokens_field}.",
            max_tokens_field)

    stop: tuple[str, ...] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    kwargs: dict[str, Any] = {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "cache_salt": req.cache_salt,
        "priority": req.priority,  # non-zero only under --scheduling-policy priority
        "repetition": _repetition(req),
    }
    for name in DEFAULTABLE:
        if kwargs[name] is None and name in defaults:
            kwargs[name] = defaults[name]
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "seed"}
    kwargs.update(constraints or {})
    try:
        return SamplingParams(max_tokens=max_tokens, stop=stop,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              logprobs=_logprobs(req),
                              prompt_logprobs=max(asked) if asked else None, **kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        if param == "max_tokens":  # the field the request named
            param = max_tokens_field
            message = max_tokens_field + message[len("max_tokens"):]
            if isinstance(req, CompletionRequest) and max_tokens == 0:
                message += " (0 returns the prompt alone with echo: true)"
        raise APIError.bad_request(message, param=param) from exc
