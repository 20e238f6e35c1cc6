"""The model's own sampling defaults (vLLM's ``--generation-config auto|vllm|FOLDER``).

A Hugging Face model folder may carry ``generation_config.json`` with the sampling its
authors recommend. These defaults fill only the fields a request omits; a request's own
values always win. ``vllm`` ignores the file's sampling (OpenAI's defaults: temperature 1,
top_p 1, no top_k, max_tokens up to the context). Fields read, as vLLM does:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (the default ``max_tokens``).

The file's ``eos_token_id`` (an id or a list) ends a generation like the model's EOS
(``ignore_eos`` and ``min_tokens`` apply), under every setting, as vLLM adds it to each
request's stop tokens: ``generation_eos_token_ids``, which ``open_checkpoint`` adds to the
checkpoint's ``ModelConfig.eos_token_ids``. Every other key (``do_sample``, ...) is
ignored. The file is read here only (``read_file``), wherever it is used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpserve.model.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# The embedded model's sampling defaults (it has no generation_config.json; applied by
# ``--generation-config auto`` like a folder's file). Greedy, by measurement: the chat
# question "What is the capital of France?" (no system prompt, seeds 0-9, max_tokens 60,
# this CPU, 2026-12-01) answered with "Paris" at temperature 0 for 10 of 10 seeds, but at
# 0.05 for 7, at 0.2 with top_p 0.9 for 6 and at 0.2 with top_k 20 for 6: the first token
# is a near tie between "The" and "L'" (-> "L'Étoile, la Marseillaise, ..."), so no
# temperature or top-k/top-p filter above 0 keeps the answer.
EMBEDDED_GENERATION_DEFAULTS: dict[str, float | int] = {"temperature": 0.0}
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


def read_file(folder: Path) -> dict[str, Any] | None:
    """``folder/generation_config.json`` parsed, or None when there is no file; ValueError
    naming the file when it is not a JSON object."""
    path = folder / FILE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_generation_config(folder: Path) -> GenerationDefaults | None:
    """The defaults in ``folder/generation_config.json``, or None when there is no file."""
    data = read_file(folder)
    return None if data is None else parse_generation_config(data, str(folder / FILE_NAME))


def parse_eos_token_ids(data: dict[str, Any], source: str) -> tuple[int, ...]:
    """A parsed file's ``eos_token_id`` (an id, a list of ids, or absent / null: none) as
    a tuple in the file's order; ValueError naming ``source`` for anything else."""
    value = data.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of token "
                         f"ids, got {value!r}")
    return tuple(ids)


def generation_config_folder(setting: str, model: str | None) -> Path | None:
    """The folder whose ``generation_config.json`` ``--generation-config setting`` names
    for ``model``: a folder argument itself; ``auto`` and ``vllm`` the model folder (a GGUF
    file's: the folder it lies in), None for the embedded model and dummy shapes, which
    have no file."""
    if setting not in ("auto", "vllm"):
        return Path(setting)
    if model is None:
        return None
    path = Path(model)
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return None  # a dummy shape name


def generation_eos_token_ids(setting: str, model: str | None) -> tuple[int, ...]:
    """The end-of-generation ids of the file ``setting`` names for ``model``
    (``generation_config_folder``; vLLM reads them for ``auto`` and ``vllm`` alike, since
    ``vllm`` drops only the sampling defaults), () when there is no file."""
    folder = generation_config_folder(setting, model)
    data = None if folder is None or not folder.is_dir() else read_file(folder)
    return () if data is None else parse_eos_token_ids(data, str(folder / FILE_NAME))


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
    model_folder = generation_config_folder(setting, model)
    if model_folder is None:  # a dummy shape name
        return GenerationDefaults({}, f"{model}: none")
    return (read_generation_config(model_folder)
            or GenerationDefaults({}, f"no {model_folder / FILE_NAME}"))
