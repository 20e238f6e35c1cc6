"""Checking a structured-output constraint without a tokenizer, and choice lists as grammars.

The HTTP layer calls ``check_structured_output`` before a request enters the engine: it
parses the schema, regex or grammar with the same library (xgrammar) the engine compiles
it with, so a constraint the engine would refuse gets a 400 naming the field instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import xgrammar as xgr

from tpserve.model.sampling_params import StructuredOutput

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
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are
    xgrammar's string-literal escapes)."""
    if not choices:
        raise GrammarError("must list at least one choice")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check_structured_output(spec: StructuredOutput) -> None:
    """Raises ``GrammarError`` with the parser's message if ``spec`` cannot be compiled."""
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(clean_message(exc)) from exc
