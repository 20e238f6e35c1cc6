"""A request's structured-output fields as the HTTP layer reads them (``http/structured.py``,
``protocol.StructuredOutputsParams``), without a server: vLLM's options of
``structured_outputs``, Lark grammars, choices beyond U+FFFF and schemas xgrammar would
not enforce."""

from __future__ import annotations

import json

import pytest

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.spec import choice_grammar
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest
from tpserve.server.http.structured import structured_output

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OPEN = {"type": "object", "properties": {"a": {"type": "integer"}},
        "unevaluatedProperties": True}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as caught:
        structured_output(chat(**fields))
    assert caught.value.status == 400
    return caught.value


def test_vllms_options_at_their_defaults_are_taken():
    """Every field of vLLM's StructuredOutputsParams at its default (what
    ``dataclasses.asdict(StructuredOutputsParams(regex=...))`` sends) is a valid request:
    the constraint is the one set."""
    body = {"json": None, "regex": "[a-z]+", "choice": None, "grammar": None,
            "json_object": None, "disable_any_whitespace": False,
            "disable_additional_properties": False, "whitespace_pattern": None,
            "structural_tag": None}
    assert structured_output(chat(structured_outputs=body)) == StructuredOutput(
        "regex", "[a-z]+")


@pytest.mark.parametrize("option", ["disable_any_whitespace", "disable_additional_properties"])
@pytest.mark.parametrize("value", [True, False])
def test_whitespace_and_additional_properties_options_are_taken_either_way(option, value):
    """``disable_any_whitespace``: the JSON grammar is always compact (what true asks of
    xgrammar in vLLM; false only permits whitespace). ``disable_additional_properties``:
    the schema compiles in xgrammar's strict mode, where an object schema that declares
    properties and leaves additionalProperties out admits no others (what true asks;
    false only permits them). Either way the constraint is the schema itself."""
    spec = structured_output(chat(structured_outputs={"json": SCHEMA, option: value}))
    assert spec == StructuredOutput("json", json.dumps(SCHEMA))


def test_disable_additional_properties_is_refused_where_the_grammar_lets_them_in():
    """A schema object opened by unevaluatedProperties (additionalProperties left out)
    lets undeclared properties through xgrammar's grammar, which vLLM's
    ``disable_additional_properties: true`` forbids (it writes additionalProperties: false
    there): 400 naming the option and where; false takes the schema."""
    error = refused(structured_outputs={"json": OPEN, "disable_additional_properties": True})
    assert error.param == "structured_outputs.disable_additional_properties"
    assert "the schema's object at # lets undeclared properties in" in error.message
    assert structured_output(chat(structured_outputs={
        "json": OPEN, "disable_additional_properties": False})).kind == "json"


def test_a_whitespace_pattern_is_refused():
    """``whitespace_pattern`` is a 400 naming it, as the top-level
    ``guided_whitespace_pattern`` is (vLLM passes it to backends that take one)."""
    error = refused(structured_outputs={"json": SCHEMA, "whitespace_pattern": r"[ ]?"})
    assert error.param == "structured_outputs.whitespace_pattern"
    assert "structured_outputs.whitespace_pattern is not supported" in error.message


def test_an_unknown_option_is_still_refused():
    """``structured_outputs`` takes vLLM's fields only: another is a 400 (Extra inputs)."""
    with pytest.raises(ValueError, match="Extra inputs"):
        chat(structured_outputs={"regex": "a", "disable_fallback": True})


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_a_lark_grammar_becomes_ebnf(field):
    """A grammar without ``::=`` is Lark, as vLLM reads it: the engine gets its EBNF;
    an EBNF grammar goes as it is."""
    lark = 'start: "yes" | "no"'
    body = {"structured_outputs": {"grammar": lark}} if field != "guided_grammar" else {
        "guided_grammar": lark}
    spec = structured_output(chat(**body))
    assert spec is not None and spec.kind == "grammar"
    assert "::=" in spec.value and "start" not in spec.value and '"yes"' in spec.value
    ebnf = 'root ::= "yes" | "no"'
    assert structured_output(chat(guided_grammar=ebnf)) == StructuredOutput("grammar", ebnf)


def test_a_lark_grammar_that_cannot_be_read_is_a_400_naming_the_field():
    """A Lark grammar neither xgrammar's Lark reader nor the conversion takes is a 400
    naming the field and the line (vLLM: 400 "Invalid grammar specification")."""
    error = refused(structured_outputs={"grammar": "start: 'a' /b+/"})
    assert error.param == "structured_outputs.grammar"
    assert error.message.startswith("invalid grammar in structured_outputs.grammar (read as "
                                    "Lark: it has no ::=): line 1: regular expressions")


@pytest.mark.parametrize("body", [{"guided_choice": ["👍", "no 👎"]},
                                  {"structured_outputs": {"choice": ["👍", "no 👎"]}}])
def test_a_choice_beyond_the_bmp_is_taken_as_written(body):
    """A choice with a character beyond U+FFFF is written into the grammar as it is (vLLM
    writes the characters as they are), not as the surrogate pair xgrammar would read as
    two lone surrogates."""
    assert structured_output(chat(**body)) == StructuredOutput(
        "grammar", 'root ::= "👍" | "no 👎"')
    assert choice_grammar(["👍", "no 👎"]) == 'root ::= "👍" | "no 👎"'


@pytest.mark.parametrize("schema, found", [
    ({"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]+$",
                                                "maxLength": 3}}, "required": ["name"]},
     "maxLength beside pattern at #/properties/name"),
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/x", "maximum": 3}},
      "required": ["n"], "$defs": {"x": {"type": "integer"}}},
     "maximum beside $ref at #/properties/n"),
    ({"allOf": [{"$ref": "#/$defs/Base"}], "properties": {"age": {"type": "integer"}},
      "required": ["age"], "$defs": {"Base": {"type": "object", "properties": {
          "name": {"type": "string"}}, "required": ["name"]}}},
     "properties beside allOf at #"),
    ({"type": "object", "properties": {"name": {"type": "string"}},
      "required": ["name", "age"]}, 'required "age" (not in properties) at #'),
])
def test_a_schema_xgrammar_would_not_enforce_is_a_400(schema, found):
    """response_format's schema with a keyword xgrammar drops is a 400 naming the field,
    the keyword and where it is (vLLM refuses schemas with features xgrammar does not
    support)."""
    error = refused(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}})
    assert error.param == "response_format.json_schema.schema"
    assert f"the schema's {found} is not enforced" in error.message
