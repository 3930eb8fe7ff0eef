"""`tool_choice` "required" or a named function, enforced: the constraint that makes the model
emit a call, in its tool parser's format, to one of the allowed functions with arguments valid
under that function's `parameters` schema (its objects closed when the tool is `strict`, as
OpenAI's strict mode has them: jaxserve.structured.strict). It is grammar-constrained decoding like any other
structured output, so it works even on a model too small to follow the tool prompt.
"""

from __future__ import annotations

from typing import Sequence

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
    schemas = {t.name: t.enforced_schema() for t in tools
               if choice.mode == "required" or t.name == choice.name}
    parallel = parallel_tool_calls and choice.mode == "required"
    return StructuredOutputsParams(grammar=parser.forced_calls_grammar(schemas, parallel),
                                   param="tools")
