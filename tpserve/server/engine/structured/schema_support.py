"""The JSON-schema keywords the grammar engine (xgrammar) would ignore without a word.

A schema keyword that constrains the instance but that xgrammar's converter drops (it
logs a warning, or nothing) would let the output break the schema the client asked for.
Such a schema is refused with a 400 naming the keyword and where it is, as vLLM refuses
what xgrammar cannot enforce. Measured on xgrammar 0.2.9 (matching strings against the
compiled grammar): ``uniqueItems``, ``not``, ``if``/``then``/``else``,
``dependentRequired``, ``dependentSchemas``, ``allOf`` with more than one branch and
``multipleOf`` on a non-integer number are ignored; ``format`` values are not checked here
(JSON Schema makes an unknown format an annotation, as the ``jsonschema`` validator reads
it too).

Only schema positions are walked (``properties`` and ``$defs`` map names to schemas), so
a property named ``not`` is no keyword; ``enum`` and ``const`` values are data.
"""

from __future__ import annotations

from typing import Any

_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
# keyword -> schemas under it: a name -> schema map, one schema (or a list), a list
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """The first keyword of ``schema`` (at its JSON pointer) the grammar would ignore, as
    ``"uniqueItems at #/properties/tags"``; None if it enforces them all."""
    if not isinstance(schema, dict):
        return None
    for key in _IGNORED:
        if key in schema:
            return f"{key} at {path}"
    if schema.get("uniqueItems") is True:
        return f"uniqueItems at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf with {len(schema['allOf'])} branches at {path}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"multipleOf on a number at {path}"
    for key, value in schema.items():
        found = None
        if key in _NAMED and isinstance(value, dict):
            found = _first(unenforced_keyword(v, f"{path}/{key}/{k}") for k, v in value.items())
        elif key in _ONE and isinstance(value, list):
            found = _first(unenforced_keyword(v, f"{path}/{key}/{i}")
                           for i, v in enumerate(value))
        elif key in _ONE:
            found = unenforced_keyword(value, f"{path}/{key}")
        elif key in _MANY and isinstance(value, list):
            found = _first(unenforced_keyword(v, f"{path}/{key}/{i}")
                           for i, v in enumerate(value))
        if found is not None:
            return found
    return None


def _first(found: Any) -> str | None:
    return next((f for f in found if f is not None), None)
