"""Counting prompt tokens: exactly through the server's /tokenize, or approximately by words."""

from __future__ import annotations

from typing import Protocol

import httpx


class TokenCounter(Protocol):
    """Counts the prompt tokens the server will see for a text (BOS included, if any)."""

    name: str

    async def count(self, text: str) -> int: ...


class WordCounter:
    """The fallback when the server has no /tokenize: one token per word.

    The words of the generated prompts are common English words, one token each in
    the usual BPE vocabularies, so this is close; the report uses the server's usage.
    """

    name = "approximate (1 token per word)"

    async def count(self, text: str) -> int:
        return len(text.split())


class ServerTokenCounter:
    """POST {base}/tokenize {"model", "prompt"} -> {"count"} (tpserve and vLLM)."""

    name = "server /tokenize"

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str) -> None:
        self._client = client
        self._url = f"{base_url}/tokenize"
        self._model = model

    async def count(self, text: str) -> int:
        response = await self._client.post(self._url, json={"model": self._model, "prompt": text})
        response.raise_for_status()
        body = response.json()
        if "count" in body:
            return int(body["count"])
        return len(body["tokens"])


async def choose_counter(client: httpx.AsyncClient, base_url: str, model: str) -> TokenCounter:
    """The server's tokenizer when /tokenize answers sensibly, else word counting."""
    counter = ServerTokenCounter(client, base_url, model)
    try:
        if await counter.count("hello world") >= 1:
            return counter
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return WordCounter()
