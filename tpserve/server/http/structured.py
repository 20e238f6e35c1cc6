"""A request's structured-output constraint and ``logit_bias``, validated before the
request enters the engine.

A constraint comes from exactly one of: ``response_format`` (``json_object``,
``json_schema`` or vLLM's ``structural_tag``; ``text`` is no constraint), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag``), or the older top-level
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. Two or more is a
400; so is a schema, regex or grammar the compiler refuses (the message is its own).

A grammar without ``::=`` is Lark, read as vLLM reads it and passed on as xgrammar's
EBNF (``structured/lark.py``). Of ``structured_outputs``' options, ``disable_any_whitespace``
is taken either way (JSON output is always compact: xgrammar's ``any_whitespace=False``,
what true asks; false only permits whitespace), ``disable_additional_properties`` too
(``unevaluated_properties_let_in`` names the one schema shape whose output true would
not hold: a 400), and ``whitespace_pattern`` is a 400, as ``guided_whitespace_pattern``.
"""

from __future__ import annotations

import json
from typing import Any

from tpserve.model.sampling_params import SamplingParams, StructuredOutput
from tpserve.server.engine.structured.lark import lark_to_ebnf, looks_like_lark
from tpserve.server.engine.structured.schema_support import unevaluated_properties_let_in
from tpserve.server.engine.structured.spec import (
    GrammarError,
    check_structured_output,
    choice_grammar,
    structural_tag,
)
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import SamplingRequest

_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
         "structural_tag": "structural tag"}


def _schema_text(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def constraint_fields(req: SamplingRequest) -> list[tuple[str, str, Any]]:
    """Every constraint the request sets: (field name, kind, value)."""
    found: list[tuple[str, str, Any]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "json_object", ""))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError.bad_request(
                "response_format of type json_schema needs json_schema.schema",
                "response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", "json",
                      fmt.json_schema.json_schema))
    elif fmt is not None and fmt.type == "structural_tag":
        if (fmt.format is None) == (fmt.structures is None):
            raise APIError.bad_request("response_format of type structural_tag needs format, "
                                       "or structures and triggers (not both)",
                                       "response_format")
        found.append(("response_format", "structural_tag", fmt.model_dump(
            by_alias=True, exclude_none=True)))
    so = req.structured_outputs
    if so is not None:
        for name, kind, value in (("json", "json", so.json_value), ("regex", "regex", so.regex),
                                  ("choice", "choice", so.choice),
                                  ("grammar", "grammar", so.grammar),
                                  ("structural_tag", "structural_tag", so.structural_tag)):
            if value is not None:
                found.append((f"structured_outputs.{name}", kind, value))
        if so.json_object:
            found.append(("structured_outputs.json_object", "json_object", ""))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value))
    return found


def structured_output(req: SamplingRequest) -> StructuredOutput | None:
    """The request's constraint, checked with the grammar compiler; APIError 400 if it
    sets more than one, the compiler refuses it or an option cannot be honoured."""
    so = req.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        raise APIError.bad_request(
            "structured_outputs.whitespace_pattern is not supported (JSON output has no "
            "whitespace beyond one space after each comma and colon)",
            "structured_outputs.whitespace_pattern")
    found = constraint_fields(req)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise APIError.bad_request(
            f"at most one structured-output constraint per request; got {names}",
            found[1][0])
    field, kind, value = found[0]
    lark = kind == "grammar" and looks_like_lark(value)
    try:
        if kind == "choice":
            spec = StructuredOutput("grammar", choice_grammar(value))
        elif kind == "json":
            spec = StructuredOutput("json", _schema_text(value))
        elif kind == "structural_tag":
            spec = StructuredOutput(kind, structural_tag(value))
        elif lark:
            spec = StructuredOutput(kind, lark_to_ebnf(value))
        else:
            spec = StructuredOutput(kind, value)
        check_structured_output(spec)
    except GrammarError as exc:
        read_as = " (read as Lark: it has no ::=)" if lark else ""
        raise APIError.bad_request(f"invalid {_WHAT.get(kind, kind)} in {field}{read_as}: "
                                   f"{exc}", field) from exc
    if so is not None and so.disable_additional_properties and kind == "json":
        _check_no_additional_properties(spec.value)
    return spec


def _check_no_additional_properties(schema: str) -> None:
    """400 for ``structured_outputs.disable_additional_properties: true`` with a schema
    whose grammar may still put in properties it does not declare."""
    where = unevaluated_properties_let_in(json.loads(schema))
    if where is not None:
        raise APIError.bad_request(
            "structured_outputs.disable_additional_properties true cannot be honoured: the "
            f"schema's object at {where} lets undeclared properties in through "
            "unevaluatedProperties (set additionalProperties false there instead)",
            "structured_outputs.disable_additional_properties")


def logit_bias(req: SamplingRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs, one a token (keys naming one token alike,
    ``"7"`` and ``" 7"``: the last wins, as in vLLM, instead of their sum); 400 for keys
    that are not token ids of the vocabulary or biases outside [-100, 100]."""
    if not req.logit_bias:
        return ()
    pairs: dict[int, float] = {}
    for key, bias in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError.bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                       "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError.bad_request(
                f"logit_bias token id {token} is out of range [0, {vocab_size})", "logit_bias")
        if not -SamplingParams.MAX_LOGIT_BIAS <= bias <= SamplingParams.MAX_LOGIT_BIAS:
            raise APIError.bad_request(
                f"logit_bias values must be in [-100, 100], got {bias} for token {token}",
                "logit_bias")
        pairs[token] = float(bias)
    return tuple(pairs.items())


def allowed_token_ids(req: SamplingRequest, vocab_size: int) -> tuple[int, ...] | None:
    """vLLM's ``allowed_token_ids`` (None: all); 400 for an empty list or ids outside the
    vocabulary."""
    if req.allowed_token_ids is None:
        return None
    ids = tuple(sorted(set(req.allowed_token_ids)))
    if not ids:
        raise APIError.bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise APIError.bad_request(
            f"allowed_token_ids must be token ids in [0, {vocab_size})", "allowed_token_ids")
    return ids
