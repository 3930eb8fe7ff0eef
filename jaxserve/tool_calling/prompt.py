"""Tools and tool messages in a chat prompt.

A chat template that reads the `tools` variable handles tools itself: it gets the tools, and the
history as HF templates expect it (an assistant message's `tool_calls[].function.arguments` as an
object, not OpenAI's JSON string). A template that writes the history's calls in its own format
without listing tools (DeepSeek-V3's: `template_call_format`) gets the history as OpenAI sends it
(arguments as JSON text, a call-only message's content null) and the tools listed in the system
message as below, with its own call format taught instead of Hermes'. Any other template gets
jaxserve's built-in fallback, in the Hermes style that the `hermes` tool parser reads:

- the tools are listed in the system message (appended to the first system/developer message, or
  a new one in front; at the start of the first user message for a template that refuses the
  system role, such as Gemma 2's), one JSON object per line inside `<tools></tools>`, followed
  by how to call them: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per
  call;
- an assistant message's `tool_calls` become such blocks after its content;
- `tool` messages become a user message of `<tool_response>...</tool_response>` blocks (adjacent
  ones merged), which any template can render.
"""

from __future__ import annotations

import json
from typing import Sequence

import jinja2
import jinja2.meta

from jaxserve.errors import InvalidRequest
from jaxserve.tool_calling.functions import FunctionTool
from jaxserve.tool_calling.parsers import detect

TOOLS_PROMPT = """# Tools

You may call one or more functions to answer the user. The functions are described by these JSON \
signatures:
<tools>
{tools}
</tools>

"""
# How to call, per format a template may write without listing tools (tool parser names).
CALL_PROMPTS = {
    "hermes": """To call functions, reply with one block per call, each holding a JSON object \
with the function's name and its arguments, and nothing else:
<tool_call>
{"name": <function-name>, "arguments": <arguments-object>}
</tool_call>""",
    "deepseek_v3": """To call functions, reply with the calls and nothing else, each call's \
arguments a JSON object:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>
```json
<arguments-object>
```<｜tool▁call▁end｜>
<｜tool▁call▁begin｜>function<｜tool▁sep｜><another-function-name>
```json
<arguments-object>
```<｜tool▁call▁end｜><｜tool▁calls▁end｜>""",
}


def template_uses_tools(source: str) -> bool:
    """Whether a chat template reads the `tools` variable (then it renders tools itself)."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False  # compiling the template reports its error


def template_call_format(source: str) -> str | None:
    """The call format (a tool parser's name) a template that does not read `tools` writes the
    history's tool calls in itself, where jaxserve can teach it (CALL_PROMPTS); else None."""
    name = detect(source)
    return name if name in CALL_PROMPTS and name != "hermes" else None


def fallback_adds_system(messages: Sequence[dict], tools: Sequence[FunctionTool]) -> bool:
    """Whether the fallback puts its tool prompt in a system message of its own."""
    return bool(tools) and not (messages and messages[0].get("role") in ("system", "developer"))


def chat_messages(messages: Sequence[dict], tools: Sequence[FunctionTool], *,
                  native: bool, tools_in_user: bool = False,
                  call_format: str | None = None) -> list[dict]:
    """The messages to render: for a template that handles tools (`native`) with tool-call
    arguments as objects; for one that writes calls in its own `call_format` (see
    template_call_format) as OpenAI sends them, with the tools prompt teaching that format; else
    with tools and tool calls written out in the fallback format.
    `tools_in_user`: with no system message, the tool prompt opens the first user message
    instead of a system message of its own (for templates that refuse the system role)."""
    if native:
        return [_native(m, i) for i, m in enumerate(messages)]
    if call_format is not None:
        out = [_openai_call(m, i) for i, m in enumerate(messages)]
        return _with_tools_prompt(out, tools, CALL_PROMPTS[call_format], tools_in_user)
    out: list[dict] = []
    in_tool_run = False  # adjacent tool messages share one user message
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text(m, i)}\n</tool_response>"
            if in_tool_run:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            in_tool_run = True
            continue
        in_tool_run = False
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(name, args) for name, args in _calls(m, i)]
            text = m.get("content") or ""
            out.append({**_plain(m), "content": "\n".join(([text] if text else []) + blocks)})
        else:
            out.append(_plain(m))
    return _with_tools_prompt(out, tools, CALL_PROMPTS["hermes"], tools_in_user)


def _with_tools_prompt(out: list[dict], tools: Sequence[FunctionTool], call_prompt: str,
                       tools_in_user: bool) -> list[dict]:
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(
            json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)) + call_prompt
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        elif tools_in_user and out and out[0].get("role") == "user":
            out[0] = {**out[0], "content": f"{prompt}\n\n{out[0].get('content') or ''}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_block(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _plain(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}


def _text(m: dict, i: int) -> str:
    content = m.get("content")
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content must be a string", param="messages")
    return content


def _calls(m: dict, i: int) -> list[tuple[str, dict]]:
    """(name, arguments object) of each of an assistant message's tool_calls."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}] needs function.name",
                                 param="messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                     f"valid JSON", param="messages") from None
        if not isinstance(args, dict):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments must be a "
                                 f"JSON object", param="messages")
        out.append((fn["name"], args))
    return out


def _openai_call(m: dict, i: int) -> dict:
    """A message as OpenAI sends it, checked; a call-only assistant message's content null
    (DeepSeek's template renders the calls only for content null, which clients also send as
    "")."""
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return dict(m)
    _calls(m, i)  # the arguments are JSON objects (rendered as the client's text)
    return {**m, "content": m.get("content") or None}


def _native(m: dict, i: int) -> dict:
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return dict(m)
    calls = [{**call, "function": {**call["function"], "arguments": args}}
             for call, (_, args) in zip(m["tool_calls"], _calls(m, i))]
    return {**m, "tool_calls": calls}
