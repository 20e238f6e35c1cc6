"""The JSON-schema keywords the grammar would ignore (``structured/schema_support.py``),
found at their schema positions and named with their JSON pointer."""

from __future__ import annotations

import json
import re

import pytest

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.schema_support import unenforced_keyword
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
