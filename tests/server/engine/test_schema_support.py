"""The JSON-schema keywords the grammar would ignore (``structured/schema_support.py``),
found at their schema positions and named with their JSON pointer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.schema_support import (
    unenforced_keyword,
    unevaluated_properties_let_in,
)
from tpserve.server.engine.structured.spec import GrammarError, check_structured_output

ARRAY = {"type": "array", "items": {"type": "integer"}}


@pytest.mark.parametrize("schema, found", [
    ({**ARRAY, "uniqueItems": True}, "uniqueItems at #"),
    ({"type": "integer", "not": {"const": 1}}, "not at #"),
    ({"if": {"const": 1}, "then": {"const": 2}}, "if at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired at #"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with 2 branches at #"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a number at #"),
    ({"type": "object", "properties": {"tags": {**ARRAY, "uniqueItems": True}}},
     "uniqueItems at #/properties/tags"),
    ({"$defs": {"P": {"not": {}}}, "$ref": "#/$defs/P"}, "not at #/$defs/P"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {"not": {}}}]},
     "not at #/anyOf/1/items"),
    ({"type": "array", "prefixItems": [{"type": "number", "multipleOf": 1.5}]},
     "multipleOf on a number at #/prefixItems/0"),
])
def test_ignored_keywords_are_found_where_they_are(schema, found):
    assert unenforced_keyword(schema) == found
    with pytest.raises(GrammarError, match=re.escape(f"the schema's {found} is not enforced")):
        check_structured_output(StructuredOutput("json", json.dumps(schema)))


@pytest.mark.parametrize("schema", [
    {**ARRAY, "uniqueItems": False},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
    {"allOf": [{"type": "integer", "minimum": 3}]},
    {"type": "integer", "multipleOf": 2},
    {"enum": [{"not": 1}, {"uniqueItems": True}]},  # data, not schemas
    {"type": "string", "format": "phone"},  # an unknown format is an annotation
])
def test_what_the_grammar_enforces_or_reads_as_annotation_passes(schema):
    assert unenforced_keyword(schema) is None
    check_structured_output(StructuredOutput("json", json.dumps(schema)))


def grammar_accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar's grammar for ``schema`` (as the server compiles it: no free
    whitespace, strict mode) accepts ``text`` whole."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


DEFS = {"int": {"type": "integer"}, "str": {"type": "string"},
        "Base": {"type": "object", "properties": {"name": {"type": "string"}},
                 "required": ["name"]}}
DRAFT7 = "http://json-schema.org/draft-07/schema#"


@pytest.mark.parametrize("schema, found, instance", [
    # a string's pattern or format (one xgrammar knows) drops the lengths; format drops pattern
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 5}, "minLength beside pattern at #",
     '"ab"'),
    ({"type": "object", "properties": {"n": {"type": "string", "pattern": "^[a-z]+$",
                                             "maxLength": 3}}},
     "maxLength beside pattern at #/properties/n", '{"n": "abcdef"}'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength beside format email at #",
     '"abcdefgh@example.com"'),
    ({"type": ["string", "null"], "format": "date", "pattern": "^1999"},
     "pattern beside format date at #", '"2020-01-01"'),
    ({"type": "object", "propertyNames": {"pattern": "^a.*$", "maxLength": 3},
      "additionalProperties": True},
     "maxLength beside pattern at #/propertyNames", '{"abcdef": 1}'),
    # xgrammar reads the first of $ref, const, enum, anyOf, oneOf, allOf and nothing beside it
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/int", "maximum": 3}},
      "$defs": DEFS}, "maximum beside $ref at #/properties/n", '{"n": 1234}'),
    ({"$ref": "#/$defs/str", "type": "integer", "$defs": DEFS}, "type beside $ref at #", '"a"'),
    ({"enum": ["abc", "a"], "maxLength": 2}, "maxLength beside enum at #", '"abc"'),
    ({"enum": ["abc", 1], "type": "string"}, "type beside enum at #", "1"),
    ({"const": "abc", "enum": ["b"]}, "enum beside const at #", '"abc"'),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}], "maxLength": 2},
     "maxLength beside anyOf at #", '"abcd"'),
    ({"type": "string", "anyOf": [{"type": "string"}, {"type": "integer"}]},
     "type beside anyOf at #", "1"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}], "allOf": [{"type": "string"}]},
     "allOf beside oneOf at #", "1"),
    ({"allOf": [{"$ref": "#/$defs/Base"}], "properties": {"age": {"type": "integer"}},
      "required": ["age"], "$defs": DEFS}, "properties beside allOf at #", '{"name": "x"}'),
    # required names the object does not declare, even where extra properties may come
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name", "age"]},
     'required "age" (not in properties) at #', '{"name": "x"}'),
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["age"],
      "additionalProperties": True}, 'required "age" (not in properties) at #', '{"name": "x"}'),
    ({"type": "object", "required": ["a"], "patternProperties": {"^a$": {"type": "integer"}}},
     'required "a" (not in properties) at #', "{}"),
    # dropped anywhere
    ({"$schema": DRAFT7, "type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}},
      "dependencies": {"a": ["b"]}}, "dependencies at #", '{"a": 1}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains at #",
     "[1]"),
    # an integer's multipleOf with a one-sided or wide range, or beyond 1024
    ({"type": "integer", "multipleOf": 3, "minimum": 1},
     "multipleOf with a range bounded on one side at #", "4"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000},
     "multipleOf over more than 10000 integers at #", "7"),
    ({"type": "integer", "multipleOf": 1025},
     "multipleOf 1025 on an integer (not a whole number up to 1024) at #", "7"),
    # a schema without a type or object / array keywords takes any value
    ({"minLength": 3}, "minLength without a type at #", '"a"'),
    ({"type": "object", "properties": {"a": {"required": ["b"]}}},
     "required without a type at #/properties/a", '{"a": {}}'),
])
def test_keywords_xgrammar_drops_are_refused(schema, found, instance):
    """Each keyword xgrammar 0.2.9 drops without a word is refused (GrammarError: a 400)
    naming it and its JSON pointer; the row's instance shows the hole: the compiled
    grammar accepts it, the schema (``jsonschema``) rejects it. vLLM refuses a schema with
    features xgrammar cannot enforce ("not supported by xgrammar") too."""
    assert grammar_accepts(schema, instance)
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert not validator.is_valid(json.loads(instance))
    assert unenforced_keyword(schema) == found
    with pytest.raises(GrammarError, match=re.escape(f"the schema's {found} is not enforced")):
        check_structured_output(StructuredOutput("json", json.dumps(schema)))


@pytest.mark.parametrize("schema", [
    # pydantic's Enum and Literal: the type holds every value the grammar allows
    {"type": "string", "enum": ["red", "green"], "title": "Color"},
    {"const": "x", "type": "string", "description": "fixed"},
    {"enum": ["a", None, 1.0], "type": ["string", "null", "integer"]},
    {"type": "object", "oneOf": [{"$ref": "#/$defs/Base"}, {"$ref": "#/$defs/Base2"}],
     "$defs": {**DEFS, "Base2": {"type": "object", "properties": {}}}},
    {"$ref": "#/$defs/str", "title": "t", "description": "d", "default": "a",
     "examples": ["a"], "$defs": DEFS},
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
     "minLength": 3},  # a string keyword on an object constrains nothing
    {"type": "object", "propertyNames": {"pattern": "^a.*$"}},  # read as a string's
    {"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 9999},
    {"type": "string", "format": "phone", "maxLength": 3},  # xgrammar keeps the length
    {"format": "email"},  # an annotation
])
def test_what_xgrammar_reads_whole_passes(schema):
    """Keywords xgrammar enforces, or drops where nothing can break them (a ``type``
    holding every value of the enum, const or branches beside it; annotations; a keyword
    for another type), pass as vLLM's xgrammar backend takes them."""
    assert unenforced_keyword(schema) is None
    check_structured_output(StructuredOutput("json", json.dumps(schema)))


@pytest.mark.parametrize("schema, found", [
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "unevaluatedProperties": True}, "#"),
    ({"$defs": {"P": {"patternProperties": {"^x$": {}}, "unevaluatedProperties": {}}}},
     "#/$defs/P"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, None),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": True, "unevaluatedProperties": True}, None),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "unevaluatedProperties": False}, None),
    ({"type": "object", "unevaluatedProperties": True}, None),
])
def test_unevaluated_properties_let_in(schema, found):
    """The object schemas whose grammar (strict mode) admits properties they do not
    declare although they leave ``additionalProperties`` out: those vLLM's
    ``disable_additional_properties`` closes (it writes ``additionalProperties: false``
    into every object schema that declares properties and leaves it out)."""
    assert unevaluated_properties_let_in(schema) == found
    if found == "#":
        assert grammar_accepts(schema, '{"a": 1, "b": 2}')
