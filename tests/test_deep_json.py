"""JSON text a client (or the model) writes nested past Python's recursion limit (review
a70e490, L3): json.loads raises RecursionError, which is no ValueError. Where the text is the
client's it is a 400 naming the field, never a 500; where it is the model's output it is no tool
call (plain content)."""

from __future__ import annotations

import pytest

from jaxserve.errors import InvalidRequest
from jaxserve.structured.params import StructuredOutputsParams
from jaxserve.tool_calling.parsers import TOOL_PARSERS
from jaxserve.tool_calling.prompt import chat_messages

DEEP = "[" * 100_000
CLOSED = "[" * 100_000 + "]" * 100_000  # well-formed, and still too deep for json.loads


@pytest.mark.parametrize("native", [True, False])
def test_deep_tool_call_arguments_in_the_history_are_a_400(native):
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": DEEP}}]}]
    with pytest.raises(InvalidRequest, match="arguments") as info:
        chat_messages(history, [], native=native)
    assert info.value.param == "messages"


def test_a_deep_json_schema_text_is_a_400():
    with pytest.raises(InvalidRequest, match="JSON schema") as info:
        StructuredOutputsParams(json=DEEP, param="guided_json")
    assert info.value.param == "guided_json"


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_deep_model_output_is_no_tool_call(name):
    parser = TOOL_PARSERS[name]()
    for text in ('<tool_call>{"name": "f", "arguments": ' + CLOSED + "}</tool_call>",
                 '{"name": "f", "arguments": ' + CLOSED + "}",
                 '{"name": "f", "parameters": ' + CLOSED + "}",
                 '[TOOL_CALLS][{"name": "f", "arguments": ' + CLOSED + "}]"):
        parsed = parser.parse(text)
        assert not parsed.tool_calls
