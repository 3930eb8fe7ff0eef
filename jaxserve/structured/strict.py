"""OpenAI's strict mode for JSON schemas: objects are closed.

OpenAI's structured outputs require `additionalProperties: false` on every object of a strict
schema (`response_format` json_schema with `strict: true`, a function tool with `strict: true`);
JSON Schema itself, and so llguidance, leaves an object that does not say it open, and a small
model then writes properties the schema never names until max_tokens. jaxserve accepts such a
schema and closes it, as xgrammar does by default: every object schema that does not say
`additionalProperties` gets `additionalProperties: false`. A schema that says it (true or a
schema) keeps what it says.

One exception: the parts of an `allOf` stay as written. JSON Schema applies `additionalProperties`
to each part alone, so closing two object parts with different properties would leave only `{}`;
such a composition keeps the openness its author wrote (docs/structured-outputs.md).

Pure Python: no grammar library.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return (kind == "object" or (isinstance(kind, list) and "object" in kind)
            or "properties" in schema)


def close_objects(schema: Any) -> Any:
    """A copy of `schema` with every object that does not say `additionalProperties` closed
    (the input is not changed). Values that are not schemas pass through as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):  # its parts' own subschemas still close
        out["allOf"] = [_close_inside(s) for s in out["allOf"]]
    elif _is_object(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _close_inside(part: Any) -> Any:
    """An allOf part: what it nests is closed, the part itself stays as written."""
    if not isinstance(part, dict):
        return part
    closed = close_objects(part)
    if "additionalProperties" not in part and isinstance(closed, dict):
        closed.pop("additionalProperties", None)
    return closed
