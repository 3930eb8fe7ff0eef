"""The `tools` and `tool_choice` of a chat request, checked once into typed values.

OpenAI's shapes: `tools` is a list of `{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}`; `tool_choice` is "none", "auto", "required" or
`{"type": "function", "function": {"name": ...}}`. Anything else is an InvalidRequest naming the
field. Whether a tool's `parameters` schema can be enforced is known when a forced call is
compiled (`jaxserve.tool_calling.choice`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jaxserve.errors import InvalidRequest
from jaxserve.structured.strict import close_objects

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: str = '{"type":"object"}'  # the JSON schema of the arguments, as JSON text
    strict: bool | None = None

    def parameters_schema(self) -> dict:
        return json.loads(self.parameters)

    def enforced_schema(self) -> dict:
        """The schema a forced call's arguments are held to: with `strict`, every object that
        does not say additionalProperties is closed (OpenAI's strict mode)."""
        schema = self.parameters_schema()
        return close_objects(schema) if self.strict else schema

    def to_openai(self) -> dict:
        """The tool as chat templates and the fallback prompt show it to the model."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters_schema()
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when named


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' {message}", param=param)


def parse_tools(value: Any, param: str = "tools") -> tuple[FunctionTool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(f"must be a list of tools, got {type(value).__name__}", param)
    if len(value) > MAX_TOOLS:
        raise _bad(f"takes at most {MAX_TOOLS} tools, got {len(value)}", param)
    tools = tuple(_function_tool(t, f"{param}[{i}]", param) for i, t in enumerate(value))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad(f"names the function {dup!r} twice", param)
    return tools


def _function_tool(tool: Any, where: str, param: str) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{where}: only {{\"type\": \"function\", \"function\": {{...}}}} tools are "
                   f"supported", param)
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise _bad(f"{where}: unknown field {unknown[0]!r}", param)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function must be an object", param)
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise _bad(f"{where}.function: unknown field {unknown[0]!r}", param)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                   f"{name!r:.60}", param)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", param)
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object"}
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON schema object", param)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict must be a boolean", param)
    return FunctionTool(name, description, json.dumps(parameters, separators=(",", ":"),
                                                      ensure_ascii=False), strict)


def parse_tool_choice(value: Any, tools: tuple[FunctionTool, ...],
                      param: str = "tool_choice") -> ToolChoice:
    """OpenAI's default: "auto" when tools are given, else "none"."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise _bad("is 'required' but no tools were given", param)
        return ToolChoice(value)
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        if name not in {t.name for t in tools}:
            raise _bad(f"names the function {name!r}, which is not among the tools", param)
        return ToolChoice("named", name)
    raise _bad(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
               f"{{\"name\": ...}}}}, got {value!r:.60}", param)
