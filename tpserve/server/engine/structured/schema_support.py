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
# keywords whose values hold schemas: a name -> schema map; one schema or a list of them
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
            "unevaluatedItems", "unevaluatedProperties", "anyOf", "oneOf", "allOf",
            "prefixItems")


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
        if key in _NAMED and isinstance(value, dict):
            subs = [(f"{path}/{key}/{k}", v) for k, v in value.items()]
        elif key in _SCHEMAS and isinstance(value, list):
            subs = [(f"{path}/{key}/{i}", v) for i, v in enumerate(value)]
        elif key in _SCHEMAS:
            subs = [(f"{path}/{key}", value)]
        else:
            continue
        for where, sub in subs:
            found = unenforced_keyword(sub, where)
            if found is not None:
                return found
    return None
