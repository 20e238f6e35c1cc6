"""Argument types shared by tpserve's own flags and the vLLM-compatible ones."""

from __future__ import annotations

import argparse
import json
from typing import Any


def json_object(value: str) -> dict[str, Any]:
    """A flag's JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return parsed


def reads_json_object(action: argparse.Action) -> bool:
    """Whether a flag takes a JSON object: typed ``json_object``, or read as JSON later
    (metavar ``JSON``: ``--hf-overrides``, ``--pooler-config``)."""
    return action.type is json_object or action.metavar == "JSON"
