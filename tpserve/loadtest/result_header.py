"""The keys vLLM's ``bench serve`` opens its JSON result with, so that scripts reading its
results read ours: ``endpoint_type`` and ``backend`` (vLLM's name of the request kind),
``model_id``, ``tokenizer_id``, then the ``--metadata KEY=VALUE`` pairs."""

from __future__ import annotations

# vLLM's --backend name of each request kind (the name a run without --backend reports)
BACKEND_OF_ENDPOINT = {"completions": "openai", "chat": "openai-chat",
                       "embeddings": "openai-embeddings"}


def parse_metadata(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--metadata`` items, each KEY=VALUE (split at the first '=', both sides stripped,
    as vLLM's); ValueError naming an item without '=' or with an empty key."""
    pairs = []
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata items are KEY=VALUE, got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def result_header(backend: str, model: str | None, tokenizer_id: str | None,
                  metadata: tuple[tuple[str, str], ...]) -> dict:
    """The result's opening keys as vLLM's (the run's parameters and figures follow, and
    win over a metadata key of the same name); of two metadata pairs of one key, the
    later wins."""
    return {"endpoint_type": backend, "backend": backend, "model_id": model,
            "tokenizer_id": tokenizer_id, **dict(metadata)}
