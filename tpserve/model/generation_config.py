"""The model's own sampling defaults (vLLM's ``--generation-config auto|vllm|FOLDER``).

A Hugging Face model folder may carry ``generation_config.json`` with the sampling its
authors recommend. These defaults fill only the fields a request omits; a request's own
values always win. ``vllm`` ignores the file (OpenAI's defaults: temperature 1, top_p 1,
no top_k, max_tokens up to the context). Fields read, as vLLM does: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (the
default ``max_tokens``); every other key (``do_sample``, token ids, ...) is ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpserve.model.loader.checkpoint import EMBEDDED_GENERATION_DEFAULTS
from tpserve.model.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INT_FIELDS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults by ``SamplingParams`` field name (only the fields that differ from
    OpenAI's defaults), and where they came from, for the start-up log."""

    params: dict[str, float | int] = field(default_factory=dict)
    source: str = "none"

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.params.items()) or "OpenAI's defaults"
        return f"default sampling parameters ({self.source}): {shown}"


def parse_generation_config(data: dict[str, Any], source: str) -> GenerationDefaults:
    """The defaults in a parsed ``generation_config.json``; ValueError naming ``source``
    for a value ``SamplingParams`` would refuse (so a bad file stops the start, not every
    request). ``null`` values are skipped."""
    params: dict[str, float | int] = {}
    for key, name in FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        number_ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not number_ok or not math.isfinite(value):
            raise ValueError(f"{source}: {key} must be a number, got {value!r}")
        if name in INT_FIELDS:
            if value != int(value):
                raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
            value = int(value)
        params[name] = value
    try:
        SamplingParams(**params)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return GenerationDefaults(params, source)


OVERRIDE_FLAG = "--override-generation-config"


def parse_overrides(overrides: dict[str, Any] | None) -> dict[str, float | int]:
    """vLLM's ``--override-generation-config`` (generation_config.json's keys) as
    ``SamplingParams`` fields; ValueError for a key this server does not read, or a value
    ``SamplingParams`` would refuse."""
    if not overrides:
        return {}
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(f"{OVERRIDE_FLAG}: {', '.join(unknown)} cannot be overridden (only "
                         f"{', '.join(FIELDS)})")
    return parse_generation_config(overrides, OVERRIDE_FLAG).params


def with_overrides(defaults: GenerationDefaults, params: dict[str, float | int]
                   ) -> GenerationDefaults:
    """``params`` (from ``parse_overrides``) over ``defaults``."""
    if not params:
        return defaults
    return GenerationDefaults({**defaults.params, **params},
                              f"{defaults.source}, with {OVERRIDE_FLAG}")


def read_generation_config(folder: Path) -> GenerationDefaults | None:
    """The defaults in ``folder/generation_config.json``, or None when there is no file."""
    path = folder / FILE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return parse_generation_config(data, str(path))


def resolve_generation_defaults(setting: str, model: str | None, load_format: str
                                ) -> GenerationDefaults:
    """``--generation-config``: ``auto`` reads the model folder's file (the embedded model:
    its measured defaults; a GGUF file: a file beside it); ``vllm`` none; anything else
    is a folder whose file must exist. Raises FileNotFoundError / ValueError."""
    if setting == "vllm":
        return GenerationDefaults({}, "--generation-config vllm")
    if setting != "auto":
        folder = Path(setting)
        found = read_generation_config(folder) if folder.is_dir() else None
        if found is None:
            raise FileNotFoundError(f"--generation-config {setting}: no {FILE_NAME} in "
                                    f"that folder")
        return found
    if model is None:
        if load_format == "dummy":
            return GenerationDefaults({}, "dummy weights: none")
        return GenerationDefaults(dict(EMBEDDED_GENERATION_DEFAULTS),
                                  "the embedded SmolLM2's measured defaults")
    path = Path(model)
    if path.is_dir():
        folder = path
    elif path.is_file():
        folder = path.parent
    else:  # a dummy shape name
        return GenerationDefaults({}, f"{model}: none")
    return read_generation_config(folder) or GenerationDefaults({}, f"no {folder / FILE_NAME}")
