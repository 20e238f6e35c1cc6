"""vLLM's ``--config FILE``: ``tpserve serve`` flags from a YAML mapping, as ``vllm serve
--config`` reads them. Each key is a flag's long name (``tensor-parallel-size`` or
``tensor_parallel_size``); flags given on the command line win over the file's.

Values map onto the command line the parser's own way: ``true`` gives a switch (``false``
leaves it out, or gives ``--no-...`` where the flag has that form), a list gives a flag
that takes several values its values and one that reads JSON its JSON (a list to any
other flag is refused, naming it), a mapping its JSON (``hf-overrides``,
``pooler-config``, ...), anything else its text. ``model`` is the model unless the command
line names one. A key that is no ``serve`` flag is refused, naming it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tpserve.server.flag_types import reads_json_object


def config_file_args(path: str, parser: argparse.ArgumentParser,
                     model_given: bool) -> list[str]:
    """The command-line arguments the YAML file at ``path`` stands for (``parser`` is the
    ``serve`` parser; ``model_given``: the command line names the model, so the file's
    ``model`` is dropped). ValueError naming the file and the key for what cannot be."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a mapping of flag names to values is expected")
    actions = {s: a for a in parser._actions for s in a.option_strings}
    out: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if name == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another")
        if name == "--model" and model_given:
            continue  # the command line's model wins
        action = actions.get(name)
        if action is None:
            raise ValueError(f"--config {path}: {key!r} is not a `tpserve serve` flag")
        out += _flag(name, value, action, path)
    return out


def _flag(name: str, value: Any, action: argparse.Action, path: str) -> list[str]:
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [name if value else "--no-" + name[2:]]
        if action.nargs == 0:  # a switch: false leaves it out
            return [name] if value else []
        return [name, "true" if value else "false"]
    if action.nargs == 0:
        raise ValueError(f"--config {path}: {name[2:]} is a switch: true or false, "
                         f"got {value!r}")
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    if isinstance(value, list):
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            return [name, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        if _takes_json(action):  # a JSON list (--allowed-origins), or refused by the flag
            return [name, json.dumps(value)]
        raise ValueError(f"--config {path}: {name[2:]} takes one value, got a list "
                         f"{value!r}")
    if value is None:
        return []
    return [name, str(value)]


def _takes_json(action: argparse.Action) -> bool:
    """Whether a one-value flag reads JSON (an object, or a list as --allowed-origins)."""
    from tpserve.server.http.cors import parse_list

    return reads_json_object(action) or action.type is parse_list or action.metavar == "LIST"
