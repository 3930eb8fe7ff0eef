"""Tool-call parsers: what a model generated -> OpenAI `tool_calls`, whole or as stream deltas.

One parser per model family, chosen by name (vLLM's `--tool-call-parser` names):
- `hermes` (Hermes, Qwen 2.5+, and jaxserve's built-in fallback prompt): content, then
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the last one may be unclosed);
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole output is `{"name": ..., "parameters":
  {...}}` (or "arguments"), optionally after `<|python_tag|>`, several joined by `;`;
- `mistral`: content, then `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}`
  objects, or (newer tokenizers) by `name[ARGS]{...}`, repeated. `[TOOL_CALLS]` is a special
  token in Mistral's vocabularies: the request must keep special tokens in its text.
- `phi4_mini_json` (Phi-4-mini): content, then `functools[` and a JSON array of `{"name",
  "arguments"}` objects.
- `openai` (gpt-oss's Harmony, jaxserve.reasoning.harmony): each message to `functions.NAME` is
  a call, its body the arguments' JSON; content is the text before the first (as the
  `openai_gptoss` reasoning parser passes on the final answer's text).
- `deepseek_v3` (DeepSeek-V3 / R1): content, then `<｜tool▁calls▁begin｜>` and calls
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` with the arguments in a ```json fence, each
  closed by `<｜tool▁call▁end｜>`. Special tokens.
`detect` picks one from a chat template (`--tool-call-parser auto`).

A call's `arguments` is the JSON text of the arguments object exactly as the model wrote it (so
the streamed fragments join to the same string). When any call is malformed (bad JSON, no name,
arguments not an object, an unfinished call), `parse` returns the whole text as content and no
calls, as vLLM does; but an output cut by max_tokens (`parse(text, cut=True)`) keeps its last,
unfinished call, with the arguments written so far (OpenAI's answer to a call cut short). Each parser also knows its format the other way round: `forced_calls_grammar`
(used by `jaxserve.tool_calling.choice`) writes the Lark grammar that makes a model emit calls.

Pure Python: no JAX, no engine.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import NamedTuple

from jaxserve.errors import ConfigError
from jaxserve.reasoning import harmony
from jaxserve.structured.grammar import lark_json


def new_tool_call_id() -> str:
    """`call_` and 24 random hex digits, the shape of OpenAI's ids."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None  # the text around the calls; None when there is none
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class StreamDelta:
    content: str  # new content text ("" if none)
    tool_calls: list[dict]  # OpenAI `delta.tool_calls` entries, at most one per call index


# ---------------------------------------------------------------------------------------------
# Scanning a JSON object as far as the text goes.


class _Call(NamedTuple):
    """A call found in the text, perhaps still being written. Spans are [start, end) with end
    None while open. `args` is the arguments value's span (None: not seen yet); `span` the
    text that must be valid JSON for the call to count (None where the format has none)."""

    name: str | None  # None until its value is complete
    args: tuple[int, int | None] | None
    complete: bool
    span: tuple[int, int | None] | None = None
    ok: bool = True  # False: the text cannot be a call any more


_BAD = _Call(None, None, True, ok=False)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level members of the JSON object opening at text[start] ('{'), as far as the text
    goes: key -> value span (end None while the value is open), and the index past the closing
    brace (None while open). Nothing is validated here; a malformed object fails json.loads
    later."""
    members: dict[str, tuple[int, int | None]] = {}
    depth, state, key = 0, "key", ""
    in_str = esc = False
    str_start = value_start = scalar_end = 0
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and state == "key_str":
                    key = _loads_str(text[str_start:i + 1])
                    state = "colon"
                elif depth == 1 and state == "string":
                    members[key] = (value_start, i + 1)
                    state = "after"
            continue
        if c.isspace():
            continue
        if c == '"':
            in_str, str_start = True, i
            if depth == 1 and state == "key":
                state = "key_str"
            elif depth == 1 and state == "value":
                value_start, state = i, "string"
                members[key] = (i, None)
        elif c in "{[":
            depth += 1
            if depth == 2 and state == "value":
                value_start, state = i, "nested"
                members[key] = (i, None)
        elif c in "}]":
            depth -= 1
            if depth == 1 and state == "nested":
                members[key] = (value_start, i + 1)
                state = "after"
            elif depth == 0:
                if state == "scalar":
                    members[key] = (value_start, scalar_end)
                return members, i + 1
        elif depth == 1:
            if c == ":" and state == "colon":
                state = "value"
            elif c == ",":
                if state == "scalar":
                    members[key] = (value_start, scalar_end)
                state = "key"
            elif state == "value":
                value_start, state = i, "scalar"
                members[key] = (i, None)
            if state == "scalar":
                scalar_end = i + 1
    return members, None


def _loads_str(raw: str) -> str:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return raw
    return value if isinstance(value, str) else raw


def _json_call(text: str, start: int, name_key: str, args_keys: tuple[str, ...]) -> _Call:
    """A call written as one JSON object at text[start] with its name and arguments members."""
    if start >= len(text):
        return _Call(None, None, False)
    if text[start] != "{":
        return _BAD
    members, end = _scan_object(text, start)
    name = None
    span = members.get(name_key)
    if span is not None and span[1] is not None:
        name = _loads_str(text[span[0]:span[1]])
    args = next((members[k] for k in args_keys if k in members), None)
    return _Call(name, args, end is not None, (start, end))


def _content_end(text: str, marker: str, final: bool) -> int:
    """Where certain content ends when no call has started: all of it at the end; while
    streaming, short of a tail that may be the start of `marker` and of trailing whitespace (it
    may turn out to stand before a call)."""
    if final:
        return len(text)
    end = len(text)
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[end - k:]):
            end -= k
            break
    return len(text[:end].rstrip())


# ---------------------------------------------------------------------------------------------
# Parsers


class ToolParser:
    """Base: a format is `_scan(text, final) -> (content_end, calls)`; parsing whole texts and
    streaming are the same scan, so they agree."""

    name = ""
    arguments_key = "arguments"
    # The format's markers are special tokens: the text must keep them (skip_special_tokens off).
    needs_special_tokens = False

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        raise NotImplementedError

    @staticmethod
    def new_call_id() -> str:
        return new_tool_call_id()

    def forced_calls_grammar(self, schemas: dict[str, dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for output made only of calls in this format, to
        the functions of `schemas` (name -> the JSON schema its arguments are held to). One
        call, or with `parallel` one or more. Formats whose call is one JSON object (`{"name",
        <arguments_key>}`) write it with `forced_grammar`; the others override this."""
        calls = [{"type": "object",
                  "properties": {"name": {"const": name}, self.arguments_key: schema},
                  "required": ["name", self.arguments_key], "additionalProperties": False}
                 for name, schema in schemas.items()]
        return self.forced_grammar(lark_json(calls[0] if len(calls) == 1 else {"anyOf": calls}),
                                   parallel)

    def forced_grammar(self, call: str, parallel: bool) -> str:
        """forced_calls_grammar's body for a JSON-object format: `call` is the Lark expression
        of one call's JSON object."""
        raise NotImplementedError

    def parse(self, text: str, *, cut: bool = False) -> ParsedToolCalls:
        """The content and calls of a whole output. `cut`: generation was cut (max_tokens), so
        a last call still being written is returned as far as it goes, its name known and its
        arguments unfinished JSON text, as a stream announced it."""
        content_end, found = self._scan(text, final=True)
        calls = [(_finished_call if c.complete or not cut else _cut_call)(text, c,
                                                                          self.new_call_id)
                 for c in found]
        if not found or any(c is None for c in calls):
            return ParsedToolCalls(text, [])
        return ParsedToolCalls(text[:content_end] or None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _arguments(text: str, call: _Call, final: bool) -> str:
    """The arguments text of a call as far as it is certain: raw JSON while it is written; a
    string-encoded object only once complete (its escapes are not the object's text)."""
    if call.args is None:
        return "{}" if call.complete else ""
    start, end = call.args
    raw = text[start:len(text) if end is None else end]
    if raw.startswith('"'):
        return _loads_str(raw) if end is not None else ""
    return raw


def _cut_call(text: str, call: _Call, new_call_id) -> ToolCall | None:
    """An unfinished call whose name is complete, with its arguments as far as they go."""
    if not (call.ok and isinstance(call.name, str) and call.name.strip()):
        return None
    return ToolCall(call.name.strip(), _arguments(text, call, final=False), new_call_id())


def _finished_call(text: str, call: _Call, new_call_id) -> ToolCall | None:
    if not (call.ok and call.complete and isinstance(call.name, str) and call.name.strip()):
        return None
    try:
        if call.span is not None:
            json.loads(text[call.span[0]:call.span[1]])
        arguments = _arguments(text, call, final=True)
        if not isinstance(json.loads(arguments), dict):
            return None
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return None
    return ToolCall(call.name.strip(), arguments, new_call_id())


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        first = text.find(self.START)
        if first < 0:
            return _content_end(text, self.START, final), []
        calls, pos = [], first
        while pos >= 0:
            call = _json_call(text, _skip_ws(text, pos + len(self.START)), "name",
                              (self.arguments_key,))
            calls.append(call)
            if not call.complete or not call.ok:
                break
            pos = text.find(self.START, call.span[1])
        return len(text[:first].rstrip()), calls

    def forced_grammar(self, call: str, parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\n"
                f'call: "{_lark(self.START)}\\n" {call} "\\n{_lark(self.END)}"\n')


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        pos = _skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = _skip_ws(text, pos + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[pos:]):
            return 0, []  # nothing but whitespace or part of the tag yet: undecided
        if pos >= len(text) or text[pos] != "{":
            return (len(text), []) if pos < len(text) or final else (0, [])
        calls = []
        while True:
            call = _json_call(text, pos, "name", ("parameters", "arguments"))
            calls.append(call)
            if not call.complete or not call.ok:
                break
            pos = _skip_ws(text, call.span[1])
            if pos >= len(text):
                break
            if text[pos] != ";":
                calls.append(_BAD)
                break
            pos = _skip_ws(text, pos + 1)
            if pos >= len(text):
                break
        return 0, calls

    def forced_grammar(self, call: str, parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {call}\n"


class MistralToolParser(ToolParser):
    name = "mistral"
    TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    @staticmethod
    def new_call_id() -> str:
        """9 letters and digits: Mistral's chat templates refuse any other tool call id."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        first = text.find(self.TOOL_CALLS)
        if first < 0:
            return _content_end(text, self.TOOL_CALLS, final), []
        content_end = len(text[:first].rstrip())
        pos = _skip_ws(text, first + len(self.TOOL_CALLS))
        if pos >= len(text):
            return content_end, []
        if text[pos] == "[":
            return content_end, _json_array(text, pos)
        calls = []
        while pos >= 0:
            call = self._named(text, pos)
            calls.append(call)
            if not call.complete or not call.ok:
                break
            pos = text.find(self.TOOL_CALLS, call.args[1])
            pos = pos if pos < 0 else _skip_ws(text, pos + len(self.TOOL_CALLS))
        return content_end, calls

    def _named(self, text: str, pos: int) -> _Call:
        """`name[ARGS]{...}`"""
        at = text.find(self.ARGS, pos)
        if at < 0:
            return _Call(None, None, False)
        brace = _skip_ws(text, at + len(self.ARGS))
        if brace < len(text) and text[brace] != "{":
            return _BAD
        end = _scan_object(text, brace)[1] if brace < len(text) else None
        return _Call(text[pos:at], (brace, end), end is not None)

    def forced_grammar(self, call: str, parallel: bool) -> str:
        # As plain text: `[TOOL_CALLS]` is a special token the grammar cannot require by name
        # without knowing the vocabulary; both spellings parse the same.
        more = ' (", " call)*' if parallel else ""
        return f'start: "{_lark(self.TOOL_CALLS)}[" call{more} "]"\ncall: {call}\n'



class Phi4MiniJsonToolParser(ToolParser):
    """Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]` after any content."""

    name = "phi4_mini_json"
    MARKER = "functools"

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        first = text.find(self.MARKER + "[")
        if first < 0:
            return _content_end(text, self.MARKER + "[", final), []
        return len(text[:first].rstrip()), _json_array(text, first + len(self.MARKER))

    def forced_grammar(self, call: str, parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        return f'start: "{self.MARKER}[" call{more} "]"\ncall: {call}\n'


class OpenAIToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        found = harmony.messages(text, final)
        content_end = found[0].end if found and found[0].channel is None else 0
        # `<|call|>` is a stop token, so the text rarely holds it: at the end, an open call whose
        # arguments are a whole JSON object is complete (one cut by max_tokens is not).
        calls = [_Call(m.function, (m.start, m.end),
                       m.complete or (final and _json_object(text[m.start:m.end])))
                 for m in found if m.function is not None]
        return content_end, calls

    def forced_calls_grammar(self, schemas: dict[str, dict], parallel: bool) -> str:
        # The call as gpt-oss writes it after the prompt's `<|start|>assistant`: a commentary
        # message to functions.NAME, its body the JSON arguments. The markers are special tokens
        # (llguidance's `<|name|>`). `<|call|>` is a stop token that ends the turn, so one call
        # per turn whatever `parallel` says; the grammar ends at the arguments and the stop
        # token follows. No analysis message first (a forced call is the whole answer).
        return ('start: <|channel|> "commentary to=functions." call\n'
                + _alternatives("call", {
                    f'"{_lark(name)} " <|constrain|> "json" <|message|> {lark_json(schema)}'
                    for name, schema in schemas.items()}))


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 / R1: content, then `<｜tool▁calls▁begin｜>` and one or more calls
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\\n```json\\n" + arguments + "\\n```" +
    `<｜tool▁call▁end｜>` (newlines between), then `<｜tool▁calls▁end｜>`: the format DeepSeek's
    chat templates write. Its markers are special tokens."""

    name = "deepseek_v3"
    needs_special_tokens = True
    CALLS, CALL, SEP, END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                             "<｜tool▁call▁end｜>")
    CALLS_END = "<｜tool▁calls▁end｜>"
    FENCE, CLOSE = "```json", "```"

    def _scan(self, text: str, final: bool) -> tuple[int, list[_Call]]:
        first = text.find(self.CALLS)
        if first < 0:
            return _content_end(text, self.CALLS, final), []
        calls, pos = [], _skip_ws(text, first + len(self.CALLS))
        while pos < len(text):
            if not text.startswith(self.CALL, pos):
                # The calls' end marker (or, while streaming, part of a marker) ends the list.
                if not (self.CALL.startswith(text[pos:]) or text.startswith(self.CALLS_END, pos)
                        or self.CALLS_END.startswith(text[pos:])):
                    calls.append(_BAD)
                break
            call, pos = self._call(text, pos + len(self.CALL))
            calls.append(call)
            if not call.complete or not call.ok:
                break
            pos = _skip_ws(text, pos)
        return len(text[:first].rstrip()), calls

    def _call(self, text: str, pos: int) -> tuple[_Call, int]:
        """One call after its begin marker: (the call, the index past its end marker)."""
        sep = text.find(self.SEP, pos)
        line = text.find("\n", sep) if sep >= 0 else -1
        if line < 0:
            return _Call(None, None, False), len(text)
        name = text[sep + len(self.SEP):line]
        fence = _skip_ws(text, line)
        if not text.startswith(self.FENCE, fence):
            ok = self.FENCE.startswith(text[fence:])  # still being written
            return (_Call(name, None, False) if ok else _BAD), len(text)
        brace = _skip_ws(text, fence + len(self.FENCE))
        if brace >= len(text):
            return _Call(name, None, False), len(text)
        if text[brace] != "{":
            return _BAD, len(text)
        end = _scan_object(text, brace)[1]
        if end is None:
            return _Call(name, (brace, None), False), len(text)
        close = _skip_ws(text, end)
        if text.startswith(self.CLOSE, close):
            after = _skip_ws(text, close + len(self.CLOSE))
            if text.startswith(self.END, after):
                return _Call(name, (brace, end), True), after + len(self.END)
            ok = self.END.startswith(text[after:])
        else:
            ok = self.CLOSE.startswith(text[close:])
        return (_Call(name, (brace, end), False) if ok else _BAD), len(text)

    def forced_calls_grammar(self, schemas: dict[str, dict], parallel: bool) -> str:
        # As DeepSeek's template writes calls, each marker one special token (llguidance's
        # `<｜name｜>`), the calls on lines of their own inside the calls markers.
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: <｜tool▁calls▁begin｜> call{more} <｜tool▁calls▁end｜>\n"
                "call: <｜tool▁call▁begin｜> \"function\" <｜tool▁sep｜> function <｜tool▁call▁end｜>\n"
                + _alternatives("function", {
                    f'"{_lark(name)}\\n```json\\n" {lark_json(schema)} "\\n```"'
                    for name, schema in schemas.items()}))


def _json_array(text: str, pos: int) -> list[_Call]:
    """Calls written as a JSON array at text[pos] ('['): `[{...}, {...}]`."""
    calls = []
    pos = _skip_ws(text, pos + 1)
    while pos < len(text):
        call = _json_call(text, pos, "name", ("arguments",))
        calls.append(call)
        if not call.complete or not call.ok:
            break
        pos = _skip_ws(text, call.span[1])
        if pos < len(text) and text[pos] == "]":
            break
        if pos < len(text) and text[pos] != ",":
            calls.append(_BAD)
            break
        pos = _skip_ws(text, pos + 1)
    return calls


def _alternatives(rule: str, bodies: set[str]) -> str:
    """A Lark rule with one alternative per body (sorted: the same grammar text, and so the
    same compiled grammar in the cache, for the same tools)."""
    return f"{rule}: " + "\n    | ".join(sorted(bodies)) + "\n"


def _lark(literal: str) -> str:
    """A literal's body inside a Lark double-quoted string."""
    return json.dumps(literal)[1:-1]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                              Phi4MiniJsonToolParser, OpenAIToolParser,
                              DeepSeekV3ToolParser)}


def detect(chat_template: str | None) -> str:
    """The tool-call parser a chat template implies: the call format it writes or teaches (a
    template that renders no tools gets jaxserve's fallback prompt, whose format is hermes)."""
    template = chat_template or ""
    for marker, name in (("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("<|call|>", "openai"), ("[TOOL_CALLS]", "mistral"),
                         ("<|python_tag|>", "llama3_json"),
                         ("functools[", "phi4_mini_json"), ("<tool_call>", "hermes")):
        if marker in template:
            return name
    return HermesToolParser.name


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r} (known: "
                          f"{', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]()


# ---------------------------------------------------------------------------------------------
# Streaming


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


class ToolCallStream:
    """Feed the generated text delta by delta; each `feed` returns the content and OpenAI
    tool-call deltas that became certain: a call's first delta carries its id, type and name
    (with arguments ""), later ones fragments of its arguments. Text that may still turn into a
    call (a partial marker, whitespace before one) is held back until it cannot, or `finish`."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def tool_calls_started(self) -> bool:
        """Whether any call was announced (the choice's finish_reason becomes "tool_calls")."""
        return bool(self._calls)

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        return self._diff(final=False)

    def finish(self) -> StreamDelta:
        """The rest, once generation ended."""
        return self._diff(final=True)

    def _diff(self, final: bool) -> StreamDelta:
        text = self._text
        content_end, calls = self._parser._scan(text, final)
        content = ""
        if content_end > self._content_sent:
            content = text[self._content_sent:content_end]
            self._content_sent = content_end
        deltas = []
        for index, call in enumerate(calls):
            if not call.ok:
                break
            entry: dict = {"index": index}
            if index == len(self._calls):
                if call.name is None:
                    break  # later calls wait for this one's name
                sent = _SentCall(self._parser.new_call_id())
                self._calls.append(sent)
                entry.update(id=sent.id, type="function",
                             function={"name": call.name.strip(), "arguments": ""})
            sent = self._calls[index]
            arguments = _arguments(text, call, final)
            if len(arguments) > sent.arguments_sent:
                entry.setdefault("function", {})["arguments"] = arguments[sent.arguments_sent:]
                sent.arguments_sent = len(arguments)
            if len(entry) > 1:
                deltas.append(entry)
        return StreamDelta(content, deltas)
