"""The JSON-schema keywords the grammar engine (xgrammar) would ignore without a word.

A schema keyword that constrains the instance but that xgrammar's converter drops (it
logs a warning, or nothing) would let the output break the schema the client asked for.
Such a schema is refused with a 400 naming the keyword and where it is, as vLLM refuses
what xgrammar cannot enforce. Measured on xgrammar 0.2.9 (matching strings against the
compiled grammar, each a string the grammar accepts and the schema rejects):

- anywhere: ``not``, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``,
  draft-07 ``dependencies``, ``contains``, ``uniqueItems``, ``allOf`` with more than one
  branch;
- xgrammar reads one keyword of ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``,
  ``allOf`` (the first present, in that order) and nothing beside it: any other
  validation keyword there is dropped (``type`` excepted where everything the kept keyword
  allows is of that type, as pydantic writes ``{"type": "string", "enum": [...]}``);
- a string's ``format`` (one xgrammar knows, ``FORMATS``) drops ``pattern``,
  ``minLength`` and ``maxLength``; its ``pattern`` drops the two lengths;
- ``multipleOf`` on a number; on an integer unless it is whole and at most 1024 and the
  range is unbounded or bounded on both sides to at most 10000 integers;
- ``required`` names an object's ``properties`` do not declare (even where
  ``additionalProperties`` or ``patternProperties`` would let them in);
- a schema with none of those keywords, no ``type`` and no object or array keyword
  (``properties``, ``items``...) takes any value: its other validation keywords
  (``minLength``, ``required``...) are dropped.

``format`` values are not checked here (JSON Schema makes a format an annotation, as the
``jsonschema`` validator reads it too), nor are keywords JSON Schema does not define.
Only schema positions are walked (``properties`` and ``$defs`` map names to schemas), so
a property named ``not`` is no keyword; ``enum`` and ``const`` values are data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "contains")
# keywords whose values hold schemas: a name -> schema map; one schema or a list of them
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
            "unevaluatedItems", "unevaluatedProperties", "anyOf", "oneOf", "allOf",
            "prefixItems")
# xgrammar reads the first of these a schema has, and none of its other keywords
_ONLY = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# the keywords that make a schema without a type an object's or an array's
_OBJECT_SHAPE = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_SHAPE = ("items", "prefixItems", "unevaluatedItems")
# validation keywords (``format`` and the annotations are not); ``additionalItems``,
# ``minContains`` and ``maxContains`` constrain nothing without an items list or contains
_TYPED = ("pattern", "minLength", "maxLength", "multipleOf", "minimum", "maximum",
          "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "required",
          "patternProperties", "propertyNames", "minProperties", "maxProperties")
_VALIDATION = frozenset((*_ONLY, "type", *_OBJECT_SHAPE, *_ARRAY_SHAPE, *_TYPED))
# the string formats xgrammar 0.2.9 writes a grammar for (others: a plain string)
FORMATS = frozenset(("date", "date-time", "time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uri", "uri-reference", "uri-template", "uuid", "json-pointer",
                     "relative-json-pointer"))
MULTIPLE_OF_MAX = 1024  # xgrammar's largest integer multipleOf
MULTIPLE_OF_RANGE_MAX = 10000  # its widest bounded range of integers with a multipleOf


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` (at its JSON pointer) the grammar would ignore, as
    ``"uniqueItems at #/properties/tags"``; None if it enforces them all."""
    return _walk(schema, schema, "#", None, _dropped_here)


def unevaluated_properties_let_in(schema: Any) -> str | None:
    """The JSON pointer of the first object schema that declares ``properties`` or
    ``patternProperties``, leaves ``additionalProperties`` out and lets other properties
    in through ``unevaluatedProperties`` (true or a schema); None if there is none.

    The grammar is compiled in xgrammar's strict mode: an object schema that sets
    neither keyword admits no property beyond those it declares, and one that declares
    none admits any. Such a schema is the only one whose output may hold properties
    that vLLM's ``disable_additional_properties`` (``additionalProperties: false`` laid
    into every object schema that declares properties and leaves it out) forbids."""
    return _walk(schema, schema, "#", None, _lets_unevaluated_in)


_Check = Callable[[dict[str, Any], Any, str, str | None], str | None]


def _walk(schema: Any, root: Any, path: str, default_type: str | None,
          check: _Check) -> str | None:
    """``check``'s first finding at ``schema`` or a subschema, in document order."""
    if not isinstance(schema, dict):
        return None
    found = check(schema, root, path, default_type)
    if found is not None:
        return found
    for key, value in schema.items():
        if key in _NAMED and isinstance(value, dict):
            subs = [(f"{path}/{key}/{k}", v) for k, v in value.items()]
        elif key in _SCHEMAS and isinstance(value, list):
            subs = [(f"{path}/{key}/{i}", v) for i, v in enumerate(value)]
        elif key in _SCHEMAS:
            subs = [(f"{path}/{key}", value)]
        else:
            continue
        # xgrammar reads a property-name schema without a type as a string's
        sub_type = "string" if key == "propertyNames" else None
        for where, sub in subs:
            found = _walk(sub, root, where, sub_type, check)
            if found is not None:
                return found
    return None


def _lets_unevaluated_in(schema: dict[str, Any], root: Any, path: str,
                        default_type: str | None) -> str | None:
    declares = any(isinstance(schema.get(k), dict) for k in ("properties", "patternProperties"))
    lets_in = schema.get("unevaluatedProperties", False) is not False
    return path if declares and lets_in and "additionalProperties" not in schema else None


def _dropped_here(schema: dict[str, Any], root: Any, path: str,
                  default_type: str | None) -> str | None:
    """The first keyword of this schema alone (not of its subschemas) that is dropped."""
    for key in _IGNORED:
        if key in schema:
            return f"{key} at {path}"
    if schema.get("uniqueItems") is True:
        return f"uniqueItems at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf with {len(schema['allOf'])} branches at {path}"
    only = next((key for key in _ONLY if key in schema), None)
    if only is not None:
        return _beside(schema, only, root, path)
    types = schema.get("type", default_type)
    if isinstance(types, str):
        types = [types]
    if not types:
        if any(key in schema for key in _OBJECT_SHAPE):
            types = ["object"]
        elif any(key in schema for key in _ARRAY_SHAPE):
            types = ["array"]
        elif "multipleOf" in schema:
            return f"multipleOf on a number at {path}"
        else:
            loose = next((key for key in _TYPED if key in schema), None)
            return None if loose is None else f"{loose} without a type at {path}"
    for kind in types:
        found = _dropped_for_type(schema, kind, path)
        if found is not None:
            return found
    return None


def _beside(schema: dict[str, Any], only: str, root: Any, path: str) -> str | None:
    """A validation keyword beside ``only``, the one keyword xgrammar reads here."""
    for key in schema:
        if key == only or key not in _VALIDATION:
            continue
        if key == "type" and _within(_types_allowed(schema, root, ()), schema["type"]):
            continue
        return f"{key} beside {only} at {path}"
    return None


def _dropped_for_type(schema: dict[str, Any], kind: Any, path: str) -> str | None:
    """A keyword for instances of type ``kind`` that xgrammar's grammar for it drops."""
    if kind == "string":
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in FORMATS:
            key = next((k for k in ("pattern", "minLength", "maxLength") if k in schema), None)
            return None if key is None else f"{key} beside format {fmt} at {path}"
        if "pattern" in schema:
            key = next((k for k in ("minLength", "maxLength") if k in schema), None)
            return None if key is None else f"{key} beside pattern at {path}"
    elif kind == "number" and "multipleOf" in schema:
        return f"multipleOf on a number at {path}"
    elif kind == "integer" and "multipleOf" in schema:
        return _integer_multiple_of(schema, path)
    elif kind == "object" and isinstance(schema.get("required"), list):
        declared = schema.get("properties")
        declared = declared if isinstance(declared, dict) else {}
        for name in schema["required"]:
            if name not in declared:
                return f"required {json.dumps(name)} (not in properties) at {path}"
    return None


def _integer_multiple_of(schema: dict[str, Any], path: str) -> str | None:
    """Why xgrammar drops this integer schema's ``multipleOf``, if it does."""
    step = schema["multipleOf"]
    if not isinstance(step, (int, float)) or step != int(step) or step > MULTIPLE_OF_MAX:
        return (f"multipleOf {step} on an integer (not a whole number up to "
                f"{MULTIPLE_OF_MAX}) at {path}")
    lows = [schema[k] + d for k, d in (("minimum", 0), ("exclusiveMinimum", 1)) if k in schema]
    highs = [schema[k] - d for k, d in (("maximum", 0), ("exclusiveMaximum", 1)) if k in schema]
    if not lows and not highs:
        return None
    if not lows or not highs:
        return f"multipleOf with a range bounded on one side at {path}"
    if min(highs) - max(lows) + 1 > MULTIPLE_OF_RANGE_MAX:
        return f"multipleOf over more than {MULTIPLE_OF_RANGE_MAX} integers at {path}"
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _within(allowed: frozenset[str] | None, declared: Any) -> bool:
    """Whether every type in ``allowed`` is one ``declared`` (a type or a list) admits."""
    names = {declared} if isinstance(declared, str) else set(declared or ())
    if "number" in names:
        names.add("integer")
    return allowed is not None and allowed <= names


def _types_allowed(schema: Any, root: Any, seen: tuple[str, ...]) -> frozenset[str] | None:
    """The JSON types of the values xgrammar's grammar for ``schema`` allows (``integer``
    apart from ``number``); None where any type may come or it cannot tell."""
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if ref is not None:
        target = _resolve(root, ref)
        return None if ref in seen or target is None else _types_allowed(
            target, root, (*seen, ref))
    if "const" in schema:
        return frozenset((_json_type(schema["const"]),))
    if isinstance(schema.get("enum"), list):
        return frozenset(_json_type(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            branches = [_types_allowed(b, root, seen) for b in schema[key]]
            if not branches or any(b is None for b in branches):
                return None
            return frozenset().union(*branches)
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset((declared,))
    if isinstance(declared, list) and declared:
        return frozenset(declared)
    if any(key in schema for key in _OBJECT_SHAPE):
        return frozenset(("object",))
    if any(key in schema for key in _ARRAY_SHAPE):
        return frozenset(("array",))
    return None


def _resolve(root: Any, ref: Any) -> Any:
    """The subschema of ``root`` a local ``$ref`` (``#/$defs/X``) names; None for others."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
