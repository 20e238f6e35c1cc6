"""``--hf-overrides`` (vLLM's): keys laid over a checkpoint's ``config.json`` before the
model's shape is read from it, e.g. ``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}}`` for Qwen's long context without editing
the file. Top-level keys replace the file's whole (a nested object is not merged), as
``PretrainedConfig.update`` does.

The overrides travel in the config tree as their canonical JSON text (frozen, hashable,
picklable for the engine process), parsed where a checkpoint is opened."""

from __future__ import annotations

import json
from typing import Any


def canonical_overrides(text: str | None) -> str | None:
    """The flag's JSON object as canonical text (sorted keys); None for none or ``{}``.
    ValueError naming the flag for anything but a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-overrides must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object of config.json keys, got "
                         f"{type(value).__name__}: {text!r}")
    return json.dumps(value, sort_keys=True) if value else None


def apply_overrides(config: dict[str, Any], overrides: str | None) -> dict[str, Any]:
    """``config`` (a parsed ``config.json``) with the canonical ``overrides`` laid over it
    (a new dict; ``config`` is left as it was)."""
    return config if overrides is None else {**config, **json.loads(overrides)}
