"""Cross-origin access for browser clients (vLLM's ``--allowed-origins`` and friends)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CorsConfig:
    """Cross-origin access for browser clients (vLLM's flags): the origins, methods and
    headers allowed, and whether credentials are."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def parse_list(value: str) -> tuple[str, ...]:
    """A flag's list: a JSON array (vLLM's form, ``'["*"]'``) or comma-separated."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("a JSON list of strings is expected")
        return tuple(items)
    return tuple(x.strip() for x in text.split(",") if x.strip())
