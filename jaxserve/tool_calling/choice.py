"""`tool_choice` "required" or a named function, enforced: the constraint that makes the model
emit a call, in its tool parser's format, to one of the allowed functions with arguments valid
under that function's `parameters` schema (its objects closed when the tool is `strict`, as
OpenAI's strict mode has them: jaxserve.structured.strict). It is grammar-constrained decoding like any other
structured output, so it works even on a model too small to follow the tool prompt.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.structured.grammar import lark_json
from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.tool_calling.functions import FunctionTool, ToolChoice
from jaxserve.tool_calling.parsers import ToolParser


def forced_tool_call(tools: Sequence[FunctionTool], choice: ToolChoice, parser: ToolParser, *,
                     parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The constraint for `choice` ("required": any of `tools`, one or more calls when
    parallel_tool_calls; "named": exactly one call of that function), or None for "auto" and
    "none" (the model writes what it wants; "none" is the caller's to honour by not parsing)."""
    if choice.mode not in ("required", "named"):
        return None
    allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name},
                             parser.arguments_key: t.enforced_schema()},
              "required": ["name", parser.arguments_key], "additionalProperties": False}
             for t in allowed]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    parallel = parallel_tool_calls and choice.mode == "required"
    return StructuredOutputsParams(grammar=parser.forced_grammar(lark_json(call), parallel),
                                   param="tools")
