"""One ``/v1/embeddings`` request, measured: a RequestResult, as vLLM's ``openai-embeddings``
backend of ``bench serve`` measures it.

The request is one non-streaming POST of the prompt text as ``input``, with
``encoding_format: "base64"`` (what the ``openai`` client sends). Its latency is the time
from sending to the whole answer read; TTFT is that same latency, there is no ITL or TPOT,
and no output tokens; the prompt tokens are the answer's ``usage.prompt_tokens``.

An answer counts only when it is what was asked for: status 200, JSON whose ``data`` holds
exactly one item whose ``embedding`` is base64 of a non-empty, finite float32 vector
(little-endian), and a ``usage.prompt_tokens`` of at least 1. Anything else is a failed
result with a message, by the conventions of ``client.failure_of``.
"""

from __future__ import annotations

import base64
import binascii
import time

import httpx
import numpy as np

from tpserve.loadtest.client import RequestResult, StreamError, error_message, failure_of
from tpserve.loadtest.datasets import PromptSpec

EMBEDDINGS_PATH = "/v1/embeddings"


class EmbeddingsSender:
    """Sends PromptSpecs to /v1/embeddings; the interface of client.RequestSender."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str,
                 timeout: float) -> None:
        self._client = client
        self._url = base_url + EMBEDDINGS_PATH
        self._model = model
        self._timeout = timeout

    def payload(self, spec: PromptSpec) -> dict:
        """The JSON body for spec (its output_len does not apply)."""
        return {"model": self._model, "input": spec.prompt, "encoding_format": "base64"}

    async def send(self, spec: PromptSpec, run_start: float) -> RequestResult:
        """Send spec and measure it; never raises except CancelledError."""
        result = RequestResult(target_input_len=spec.target_input_len)
        sent = time.perf_counter()
        result.start = sent - run_start
        error = await failure_of(self._post(spec, result), self._timeout)
        result.latency = time.perf_counter() - sent
        result.success, result.error = error is None, error or ""
        if result.success:
            result.ttft = result.latency
        return result

    async def _post(self, spec: PromptSpec, result: RequestResult) -> None:
        response = await self._client.post(self._url, json=self.payload(spec))
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {error_message(response.content)}")
        try:
            body = response.json()
        except ValueError:
            raise StreamError(f"malformed answer, not JSON: {response.text[:80]!r}") from None
        result.prompt_tokens = check_answer(body)
        result.usage_reported = True


def check_answer(body: object) -> int:
    """The prompt tokens of an embeddings answer to one input; StreamError saying what is
    wrong when it is not one base64 float32 embedding with its usage."""
    if not isinstance(body, dict):
        raise StreamError(f"malformed answer: expected a JSON object, got {type(body).__name__}")
    if "error" in body:
        raise StreamError(f"error in the answer: {body['error']}")
    data = body.get("data")
    if not isinstance(data, list) or len(data) != 1:
        count = len(data) if isinstance(data, list) else "no list"
        raise StreamError(f"malformed answer: expected one item in data, got {count}")
    item = data[0]
    embedding = item.get("embedding") if isinstance(item, dict) else None
    if not isinstance(embedding, str):
        raise StreamError("malformed answer: data[0].embedding is not base64 text")
    vector = decode_base64_float32(embedding)
    if vector.size == 0:
        raise StreamError("malformed answer: data[0].embedding is empty")
    if not np.isfinite(vector).all():
        raise StreamError("malformed answer: data[0].embedding has NaN or infinite values")
    usage = body.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise StreamError(f"malformed answer: usage.prompt_tokens is {tokens!r}, "
                          "expected a positive integer")
    return tokens


def decode_base64_float32(text: str) -> np.ndarray:
    """The little-endian float32 vector of base64 text; StreamError if it is not one."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise StreamError("malformed answer: data[0].embedding is not valid base64") from None
    if len(raw) % 4:
        raise StreamError(f"malformed answer: data[0].embedding has {len(raw)} bytes, "
                          "not a whole number of float32 values")
    return np.frombuffer(raw, dtype="<f4")
