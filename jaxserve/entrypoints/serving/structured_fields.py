"""A validated request's structured-output and tool fields -> the typed values the serving layer
uses: one StructuredOutputsParams (or none), and the tools with their tool_choice.

Structured outputs come from OpenAI's `response_format` (`json_object`, `json_schema`; `text` is
no constraint), vLLM's `structured_outputs` ({json|regex|choice|grammar|json_object}) or its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one of them may be
given: two constraints on one output would have to be intersected, which no client expects.
A forced `tool_choice` (required / named) is a constraint of its own, so it cannot be combined
with a structured output either. Each constraint names the field it came from, so the grammar
compiler's 400 for a schema it cannot enforce names it too. A `strict` json_schema has its
objects closed (jaxserve.structured.strict). No JAX, no grammar library.
"""

from __future__ import annotations

from typing import Any

from jaxserve.errors import InvalidRequest
from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.structured.strict import close_objects
from jaxserve.tool_calling.functions import FunctionTool, ToolChoice, parse_tool_choice, parse_tools

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_constraint(req: Any) -> StructuredOutputsParams | None:
    """The request's one structured-output constraint, or None; InvalidRequest naming the field
    when its value is malformed or a second one is given."""
    given: list[StructuredOutputsParams] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(StructuredOutputsParams(json_object=True, param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        if schema is not None and fmt.json_schema.strict:
            schema = close_objects(schema)
        given.append(StructuredOutputsParams(json=schema, param="response_format")
                     if schema is not None
                     else StructuredOutputsParams(json_object=True, param="response_format"))
    so = req.structured_outputs
    if so is not None:
        given.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                             grammar=so.grammar,
                                             json_object=bool(so.json_object),
                                             param="structured_outputs"))
    for name, kind in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            given.append(StructuredOutputsParams(**{kind: value}, param=name))
    if len(given) > 1:
        raise InvalidRequest(f"'{given[1].param}' cannot be combined with '{given[0].param}': "
                             f"give one structured-output constraint", param=given[1].param)
    return given[0] if given else None


def tool_fields(req: Any, constraint: StructuredOutputsParams | None
                ) -> tuple[tuple[FunctionTool, ...], ToolChoice, bool]:
    """(tools, tool_choice, parallel_tool_calls) of a chat request."""
    tools = parse_tools(None if req.tools is None
                        else [t.model_dump(exclude_none=True) for t in req.tools])
    choice_value = req.tool_choice
    if choice_value is not None and not isinstance(choice_value, str):
        choice_value = choice_value.model_dump()
    choice = parse_tool_choice(choice_value, tools)
    if choice.mode in ("required", "named") and constraint is not None:
        raise InvalidRequest(f"a forced 'tool_choice' cannot be combined with "
                             f"'{constraint.param}'", param="tool_choice")
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return tools, choice, parallel
