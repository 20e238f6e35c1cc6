"""One streaming request to an OpenAI-compatible server, measured: a RequestResult.

Times come from time.perf_counter(). As in vLLM's ``bench serve``, every chunk with a
non-empty ``choices`` is timed, whatever its text (empty for special tokens; thinking
under ``delta.reasoning`` or ``reasoning_content``): TTFT is the time to the first one,
ITL the gaps between them. One exception: a chat chunk that only announces the role
(``{"role": "assistant", "content": ""}``, no finish_reason) carries no token and is not
timed, since a server may send it before the prefill. A 200 stream with no timed chunk
is a failed request (vLLM's "Never received a valid chunk"). Token counts come from the
final ``usage`` chunk (``stream_options.include_usage``); without it, the input tokens
are the prompt's known length (``PromptSpec.target_input_len``) and the output tokens the
number of timed chunks. Every failure (HTTP status, error event in
the stream, timeout, connection error, malformed stream) becomes a failed result with
a message; cancellation (Ctrl-C) is not a failure and propagates. ``failure_of`` holds
that convention for every kind of request (the embeddings one too).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from tpserve.loadtest.datasets import PromptSpec
from tpserve.loadtest.sse import iter_events

MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; ``start`` and ``chunk_times`` are
    relative to the run's start so that runs can be plotted over time."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    target_input_len: int | None = None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class Sender(Protocol):
    """What a run needs of a request kind: send one PromptSpec and measure it."""

    async def send(self, spec: PromptSpec, run_start: float) -> RequestResult: ...


class StreamError(Exception):
    """The server reported an error, or its answer (a stream, an embeddings body) broke
    the protocol."""


async def failure_of(work: Awaitable[None], timeout: float) -> str | None:
    """Await ``work`` for at most ``timeout`` seconds: None when it completed, else why it
    failed (clipped to MAX_ERROR_CHARS). Never raises except CancelledError."""
    try:
        await asyncio.wait_for(work, timeout)
    except asyncio.TimeoutError:
        return f"timeout after {timeout:g}s"
    except httpx.TimeoutException as e:
        return f"timeout ({type(e).__name__})"
    except httpx.HTTPError as e:
        return clip_error(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    except StreamError as e:
        return clip_error(str(e) or "protocol error")
    except Exception as e:  # any other failure is a failed request, never a crash
        return clip_error(f"{type(e).__name__}: {e}")
    return None


class RequestSender:
    """Sends PromptSpecs as streaming completions or chat completions.

    The httpx client carries the headers (API key) and the connection pool.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        endpoint: str,
        ignore_eos: bool,
        timeout: float,
        temperature: float = 0.0,
    ) -> None:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self._client = client
        self._url = base_url + path
        self._model = model
        self._chat = endpoint == "chat"
        self._ignore_eos = ignore_eos
        self._timeout = timeout
        self._temperature = temperature

    def payload(self, spec: PromptSpec) -> dict:
        """The JSON body for spec."""
        body: dict = {
            "model": self._model,
            "max_tokens": spec.output_len,
            "temperature": self._temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self._ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, spec: PromptSpec, run_start: float) -> RequestResult:
        """Send spec and measure it; never raises except CancelledError."""
        result = RequestResult(target_input_len=spec.target_input_len)
        sent = time.perf_counter()
        result.start = sent - run_start
        error = await failure_of(self._stream(spec, result, sent, run_start), self._timeout)
        result.success, result.error = error is None, error or ""
        result.latency = time.perf_counter() - sent
        return result

    async def _stream(
        self, spec: PromptSpec, result: RequestResult, sent: float, run_start: float
    ) -> None:
        body = self.payload(spec)
        async with self._client.stream("POST", self._url, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                raise StreamError(f"HTTP {response.status_code}: {error_message(raw)}")
            done = False
            last = sent
            async for event in iter_events(response.aiter_lines()):
                if event.data.strip() == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(event.data)
                except json.JSONDecodeError:
                    raise StreamError(f"malformed stream chunk: {event.data[:80]!r}") from None
                if event.event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                    raise StreamError(f"stream error: {_message_of(chunk)}")
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.usage_reported = True
                if _timed(chunk, self._chat):
                    now = time.perf_counter()
                    if not result.chunk_times:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunk_times.append(now - run_start)
            if not done:
                raise StreamError("stream ended without data: [DONE]")
        if not result.chunk_times:
            raise StreamError(NO_VALID_CHUNK)
        if not result.usage_reported:
            result.output_tokens = len(result.chunk_times)
            result.prompt_tokens = spec.target_input_len or 0


NO_VALID_CHUNK = "Never received a valid chunk to calculate TTFT"


def _timed(chunk: dict, chat: bool) -> bool:
    """Whether chunk is timed: it has choices, unless it is a chat chunk that only
    announces the role (see the module docstring)."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices, list):
        return False
    if not chat:
        return True
    choice = choices[0] if isinstance(choices[0], dict) else {}
    delta = choice.get("delta") or {}
    announcement = (not choice.get("finish_reason") and "role" in delta
                    and not any(v for k, v in delta.items() if k != "role"))
    return not announcement


def _message_of(obj: object) -> str:
    """The human message of an OpenAI-style error body (or the body itself)."""
    if isinstance(obj, dict):
        error = obj.get("error", obj)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)
        return str(error)
    return str(obj)


def error_message(raw: bytes) -> str:
    """The message of an error response's body (OpenAI's envelope, or the text itself)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        return _message_of(json.loads(text))
    except json.JSONDecodeError:
        return text or "(empty body)"


def clip_error(text: str) -> str:
    """text, cut to MAX_ERROR_CHARS."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
