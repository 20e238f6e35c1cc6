"""Checking a structured-output constraint without a tokenizer, and choice lists as grammars.

The HTTP layer calls ``check_structured_output`` before a request enters the engine: it
parses the schema, regex, grammar or structural tag with the same library (xgrammar) the
engine compiles it with, so a constraint the engine would refuse gets a 400 naming the
field instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.schema_support import unenforced_keyword

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes with
# "Check failed: (...) is false: "; neither helps a client.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


class GrammarError(ValueError):
    """A schema, regex or grammar the compiler refuses; the message is the compiler's."""


def clean_message(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    first = _CHECK.sub("", _LOCATION.sub("", lines[0] if lines else type(exc).__name__))
    return " ".join([first, *lines[1:3]])[:500]


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. Each is written as a JSON
    string (JSON's escapes are xgrammar's string-literal escapes) with its characters as
    they are: quotes, backslashes and control characters escaped, the rest in UTF-8.
    ``ensure_ascii`` would write a character beyond U+FFFF as two ``\\u`` surrogate escapes,
    which xgrammar reads as two lone surrogates, so such a choice could never be output.
    ``GrammarError`` for no choices or a choice holding a lone surrogate (no UTF-8 text)."""
    if not choices:
        raise GrammarError("must list at least one choice")
    for i, choice in enumerate(choices):
        try:
            choice.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise GrammarError(f"choice {i} holds a lone surrogate ({exc.object[exc.start]!r}"
                               "), which no output text can hold") from None
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_structured_output(spec: StructuredOutput) -> None:
    """Raises ``GrammarError`` with the parser's message if ``spec`` cannot be compiled, or
    naming a schema keyword the grammar would ignore (``schema_support``)."""
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value)
            ignored = unenforced_keyword(json.loads(spec.value))
            if ignored is not None:
                raise GrammarError(f"the schema's {ignored} is not enforced by the grammar "
                                   "engine (xgrammar), so the output could break it: leave "
                                   "it out")
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(clean_message(exc)) from exc


def structural_tag(value: str | dict[str, Any]) -> str:
    """vLLM's structural tag (a JSON object or its text) as xgrammar's current form: the
    legacy ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` becomes the
    same triggered tags (free text until a trigger, then one of the tags starting with it,
    its content following its schema; free text again after its end); any other object
    is taken as it is (``{"type": "structural_tag", "format": ...}``). ``GrammarError`` for
    text that is no JSON object or a legacy tag without its fields."""
    try:
        tag = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise GrammarError(f"not JSON: {exc}") from exc
    if not isinstance(tag, dict):
        raise GrammarError("must be a JSON object")
    if "structures" not in tag:
        return json.dumps(tag)
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise GrammarError("triggers must be a list of strings")
    try:
        tags = [{"type": "tag", "begin": s["begin"],
                 "content": {"type": "json_schema", "json_schema":
                             {} if s.get("schema") is None else s["schema"]},
                 "end": s["end"]} for s in tag["structures"]]
    except (KeyError, TypeError) as exc:
        raise GrammarError(f"structures need begin and end ({exc!r} missing or "
                           "wrong)") from exc
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}})
