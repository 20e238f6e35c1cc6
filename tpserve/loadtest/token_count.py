"""Counting prompt tokens: exactly through the server's /tokenize, or approximately by words."""

from __future__ import annotations

from typing import Protocol

import httpx


class TokenCounter(Protocol):
    """Counts the prompt tokens the server will see for a text (BOS included, if any)."""

    name: str
    # the model whose tokenizer counts (vLLM's tokenizer_id); None: no tokenizer's
    tokenizer_id: str | None

    async def count(self, text: str) -> int: ...


class WordCounter:
    """The fallback when the server has no /tokenize: one token per word.

    The words of the generated prompts are common English words, one token each in
    the usual BPE vocabularies, so this is close; the report uses the server's usage.
    """

    name = "approximate (1 token per word)"
    tokenizer_id = None

    async def count(self, text: str) -> int:
        return len(text.split())


class ServerTokenCounter:
    """POST {base}/tokenize (tpserve and vLLM): {"model", "prompt"} -> {"count"}.

    With ``chat`` the text is sent as one user message ({"model", "messages",
    "add_generation_prompt": true}), so the count includes the chat template.
    """

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, model: str, chat: bool = False
    ) -> None:
        self._client = client
        self._url = f"{base_url}/tokenize"
        self._model = model
        self._chat = chat
        self.name = "server /tokenize (chat template included)" if chat else "server /tokenize"
        self.tokenizer_id = model

    async def count(self, text: str) -> int:
        body: dict = {"model": self._model}
        if self._chat:
            body["messages"] = [{"role": "user", "content": text}]
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = text
        response = await self._client.post(self._url, json=body)
        response.raise_for_status()
        result = response.json()
        if "count" in result:
            return int(result["count"])
        return len(result["tokens"])


async def choose_counter(
    client: httpx.AsyncClient, base_url: str, model: str, chat: bool = False
) -> TokenCounter:
    """The server's tokenizer when /tokenize answers sensibly, else word counting.

    For chat, a server that cannot tokenize messages still counts the message text.
    A server that cannot be reached (httpx.TransportError: refused connection, timeout)
    is not a server without /tokenize: the error propagates.
    """
    candidates = [ServerTokenCounter(client, base_url, model, chat=True)] if chat else []
    candidates.append(ServerTokenCounter(client, base_url, model))
    for counter in candidates:
        try:
            if await counter.count("hello world") >= 1:
                return counter
        except httpx.TransportError:
            raise
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            continue
    return WordCounter()
