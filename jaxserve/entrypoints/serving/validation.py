"""Untrusted bytes -> a validated request model, or one InvalidRequest naming the field.

Two bounded steps. `load_json` parses a body: malformed JSON (NaN and Infinity included, which
JSON does not have), nesting deeper than the limit and text that is not valid Unicode (a lone
surrogate such as "\\ud800" is valid JSON but no tokenizer can take it) are 400s, never a
RecursionError or a TypeError deep in the tokenizer. `validate` checks the value against a
pydantic model (strict types, unknown fields refused) and turns pydantic's errors into one
InvalidRequest whose `param` is the field's path, in OpenAI's words where OpenAI has them
("Unrecognized request argument supplied: NAME").
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from jaxserve.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def load_json(data: bytes | str, max_depth: int) -> Any:
    """Parse a JSON document; InvalidRequest (param: the top-level field) for anything hostile."""
    try:
        value = json.loads(data, parse_constant=_no_constants)
    except RecursionError:
        raise InvalidRequest(f"the JSON body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, huge ints, NaN, bad UTF-8
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    check_json_value(value, max_depth)
    return value


def check_json_value(value: Any, max_depth: int) -> None:
    """Nesting depth (a scalar is depth 0, `[]` depth 1) and Unicode of every string and key,
    walked without recursion."""
    stack = [(value, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise InvalidRequest(
                    f"{_where(field)}holds text that is not valid Unicode (a lone UTF-16 "
                    f"surrogate such as \\ud800)", param=field)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise InvalidRequest(f"the JSON body nests deeper than {max_depth} levels",
                                 param=field)
        if isinstance(node, dict):
            for key, item in node.items():
                stack.append((key, depth + 1, field))
                # Errors below a top-level key name it (once the key itself is known to be sound).
                stack.append((item, depth + 1, key if depth == 1 and not _SURROGATE.search(key)
                              else field))
        else:
            stack.extend((item, depth + 1, field) for item in node)


def _where(field: str | None) -> str:
    return f"'{field}' " if field else "the body "


def validate(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(model, exc.errors(include_url=False)) from None


# ---- pydantic errors -> one InvalidRequest ----------------------------------------------------

_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "list_type": "a list", "dict_type": "an object",
             "model_type": "an object", "none_required": "null"}
_TYPE_NAMES = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
               "float": ("a number", "numbers"), "bool": ("a boolean", "booleans")}


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """Every field name of the model and of the models nested in it: what in an error location
    is a field, as opposed to the tag pydantic gives a union member ('str', 'list[int]')."""
    names, seen, todo = set(), set(), [model]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for name, info in m.model_fields.items():
            names.add(info.alias or name)  # errors locate a field by its alias ("schema")
            todo.extend(_models_in(info.annotation))
    return frozenset(names)


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _locate(model: type[BaseModel], error: dict) -> tuple[str, str, str | None]:
    """(param, path, union tag): param is the dotted path of fields down to the first list
    index ("messages", "stream_options.include_usage"); path is the full location for the
    message ("messages[0].role"); the tag names the union member the error comes from."""
    fields = _field_names(model)
    loc = list(error["loc"])
    # An unknown key is the client's text: cut to a readable length before it goes in a reply.
    unknown = f"{loc.pop():.100}" if error["type"] == "extra_forbidden" else None
    param, path, tag, indexed = [], "", None, False
    for item in loc:
        if isinstance(item, int):
            path, indexed = f"{path}[{item}]", True
        elif item in fields:
            path = f"{path}.{item}" if path else item
            if not indexed:
                param.append(item)
        elif tag is None:
            tag = item
    if unknown is not None:
        path = f"{path}.{unknown}" if path else unknown
        if not param:  # at the top level OpenAI names the unknown argument itself
            param.append(unknown)
    return ".".join(param), path, tag


def _describe_tag(tag: str) -> str:
    # "list[function-before[_integral(), int]]" is a list of ints to the client.
    tag = re.sub(r"function-\w+\[[^,\]]*, ([^\]]+)\]", r"\1", tag.replace("constrained-", ""))
    if tag.startswith("list[") and tag.endswith("]"):
        inner = tag[5:-1]
        if inner.startswith("list["):
            return "a list of lists"
        return f"a list of {_TYPE_NAMES.get(inner, ('', 'objects'))[1]}"
    return _TYPE_NAMES.get(tag, ("an object",))[0]


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r:.60}"


@functools.cache
def _properties(model: type[BaseModel]) -> dict:
    return model.model_json_schema()["properties"]  # built once: errors must stay cheap


def _bounds(model: type[BaseModel], param: str) -> tuple[Any, Any]:
    """(minimum, maximum) of a top-level field, from the JSON schema the model publishes."""
    prop = _properties(model).get(param, {})
    for option in [prop, *prop.get("anyOf", [])]:
        if "minimum" in option or "maximum" in option:
            return option.get("minimum"), option.get("maximum")
    return None, None


def _invalid(model: type[BaseModel], errors: list[dict]) -> InvalidRequest:
    param, path, _ = _locate(model, errors[0])
    mine = [e for e in errors if _locate(model, e)[0] == param]
    field = model.model_fields.get(param.split(".")[0])
    neutral = (field.json_schema_extra or {}).get("x-neutral") if field is not None else None
    if neutral is not None:
        param = param.split(".")[0]
        return InvalidRequest(f"'{param}' is not supported by this server (only {neutral} is "
                              f"accepted)", param=param)
    if len(mine) > 1 and all(e["type"] in _EXPECTED for e in mine):
        # Every member of a union refused the value's type: name the shapes it may take.
        tags = dict.fromkeys(_describe_tag(t) for e in mine if (t := _locate(model, e)[2]))
        root = next((e["input"] for e in mine if _locate(model, e)[1] == path), None)
        *rest, last = list(tags) or ["valid"]
        shapes = f"{', '.join(rest)} or {last}" if rest else last
        return InvalidRequest(f"'{path}' must be {shapes}, {_got(root)}", param=param)
    # Else the most specific complaint: the deepest one that is not a union member's type error.
    error = max((e for e in mine if e["type"] not in _EXPECTED), key=lambda e: len(e["loc"]),
                default=mine[0])
    _, path, _ = _locate(model, error)
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {path}"
    elif kind == "missing":
        message = f"'{path}' is required"
    elif kind in _EXPECTED:
        message = f"'{path}' must be {_EXPECTED[kind]}, {_got(value)}"
    elif kind == "literal_error":
        message = f"'{path}' must be {ctx['expected']}, got {value!r:.60}"
    elif kind == "too_short" and ctx.get("min_length") == 1:
        message = f"'{path}' must be non-empty"
    elif kind == "too_long":
        message = (f"'{path}' takes at most {ctx['max_length']} items, got "
                   f"{ctx.get('actual_length')}")
    elif kind == "string_too_short" and ctx.get("min_length") == 1:
        message = f"'{path}' must not be empty"
    elif kind == "string_too_long":
        message = f"'{path}' must be at most {ctx['max_length']} characters long"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        low, high = _bounds(model, param) if path == param else (None, None)
        if low is not None and high is not None:
            message = f"'{path}' must be in [{low}, {high}], got {value!r}"
        else:
            bound = error["msg"].replace("Input should be", "must be")
            message = f"'{path}' {bound}, got {value!r:.60}"
    else:
        message = f"'{path}': {error['msg']}"
    return InvalidRequest(message, param=param)
