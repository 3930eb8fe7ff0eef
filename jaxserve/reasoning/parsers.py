"""Reasoning parsers: what a reasoning model generated -> (reasoning, content), whole or as stream
deltas.

Chosen by name (vLLM's `--reasoning-parser` names), or from the chat template (`detect`):
- `qwen3`: Qwen3's `<think>...</think>` block: the output is reasoning while it is inside the
  block, which opens at the start of the output (`<think>`, after whitespace) or in the prompt (a
  template that writes `<think>` into the generation prompt, as Qwen3-Thinking-2507 and QwQ do).
  `enable_thinking: false` closes the block in the prompt, so the output is content.
- `deepseek_r1`: the same block, but the output always starts inside it (DeepSeek-R1 and its
  distills; their templates open it in the prompt, older ones let the model write `<think>`).
- `openai_gptoss` (gpt-oss's Harmony, jaxserve.reasoning.harmony): the `analysis` channel's
  messages are the reasoning; the content is the `final` channel's (and commentary preambles')
  text, followed by each tool-call message whole for the `openai` tool-call parser.

The reasoning is the block's text without the newlines that frame it; the content is what follows
`</think>`, leading whitespace dropped. A block never closed (cut by max_tokens) is all reasoning.
Where the markers are special tokens of a vocabulary, the request keeps special tokens in its text
(`needs_special_tokens`). A parser is a `_scan` (what of the text is certain), so parsing whole
texts and streaming are the same scan and agree, as the tool-call parsers do
(jaxserve.tool_calling.parsers): the content a reasoning parser passes on goes to the tool-call
parser. A format that interleaves both (gpt-oss's Harmony channels) plugs in as a parser of
each kind over the same markers.

Pure Python: no JAX, no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from jaxserve.errors import ConfigError
from jaxserve.reasoning import harmony


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output had no reasoning
    content: str


class _Scan(NamedTuple):
    """What of a text is certain: reasoning text[start:end]; content from `content` on (None:
    not started yet, or the text is undecided)."""

    start: int
    end: int
    content: int | None
    has_reasoning: bool


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of text may begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    name = ""
    START, END = "<think>", "</think>"
    always_starts_in_reasoning = False

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether the output begins inside the block, given the end of the rendered prompt."""
        if self.always_starts_in_reasoning:
            return True
        return prompt_tail.rfind(self.START) > prompt_tail.rfind(self.END)

    def grammar(self, opened: bool) -> str:
        """Lark (llguidance's dialect) for a structured output that follows this format's
        reasoning: a `start` rule reading the block, then `body` (the caller's rule). The block
        is free text, opened by the prompt or optional and opened by the model, and a lazy
        lexeme ended by the end marker, so its text is anything up to the first end marker."""
        block = "thought WS?" if opened else f"({json.dumps(self.START)} thought WS?)?"
        return (f"start: {block} body\n"
                f"thought[suffix={json.dumps(self.END)}]: /(.|\\n)*/\n"
                f"WS: /[ \\t\\r\\n]+/\n")

    def _scan(self, text: str, in_reasoning: bool, final: bool) -> _Scan:
        in_reasoning = in_reasoning or self.always_starts_in_reasoning
        lead = len(text) - len(text.lstrip())
        if text.startswith(self.START, lead):
            in_reasoning, start = True, lead + len(self.START)
        elif not final and self.START.startswith(text[lead:]):
            return _Scan(0, 0, None, False)  # whitespace or part of "<think>": undecided
        elif not in_reasoning:
            return _Scan(0, 0, 0, False)
        else:
            start = 0
        while start < len(text) and text[start] == "\n":
            start += 1
        close = text.find(self.END, start)
        if close < 0:  # still thinking: hold back what may be the end marker or trailing newlines
            end = len(text) if final else len(text) - _partial_suffix(text, self.END)
            end = max(start, len(text[:end].rstrip("\n")))
            return _Scan(start, end, None, True)
        after = close + len(self.END)
        content = after + len(text[after:]) - len(text[after:].lstrip())
        return _Scan(start, max(start, len(text[:close].rstrip("\n"))), content, True)

    def split(self, text: str, *, in_reasoning: bool = False) -> ReasoningSplit:
        scan = self._scan(text, in_reasoning, final=True)
        content = "" if scan.content is None else text[scan.content:]
        if not scan.has_reasoning:
            return ReasoningSplit(None, content)
        return ReasoningSplit(text[scan.start:scan.end], content)

    def stream(self, *, in_reasoning: bool = False) -> ReasoningStream:
        return ReasoningStream(self, in_reasoning)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_starts_in_reasoning = True


class HarmonyReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    START, END = harmony.CHANNEL, "<|end|>"  # special tokens: the text must keep them

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        return False  # the output opens with a message's header

    def grammar(self, opened: bool) -> str:
        # Harmony's markers are special tokens: named unquoted, as tokens (quoted, llguidance
        # holds them to their text, which the model could then only spell out in plain
        # characters). An optional analysis message, then the final message holds the body.
        channel, message = harmony.CHANNEL, harmony.MESSAGE
        return (f'start: ({channel} "analysis" {message} thought {self.END} {harmony.START} '
                f'"assistant")? {channel} "final" {message} body\n'
                f"thought: /(.|\\n)*/\n")

    def parts(self, text: str, final: bool) -> tuple[str | None, str]:
        """(the analysis messages' text, None if none; the content, tool calls whole)."""
        reasoning, content = [], []
        for m in harmony.messages(text, final):
            body = text[m.start:m.end]
            if m.function is not None:
                content.append(harmony.call_text(m.function, body, m.complete))
            elif m.channel == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return ("\n".join(reasoning) if reasoning else None), "".join(content)

    def split(self, text: str, *, in_reasoning: bool = False) -> ReasoningSplit:
        return ReasoningSplit(*self.parts(text, final=True))

    def stream(self, *, in_reasoning: bool = False) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(self)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser,
                              HarmonyReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ConfigError(f"unknown reasoning parser {name!r} (known: "
                          f"{', '.join(sorted(REASONING_PARSERS))})")
    return REASONING_PARSERS[name]()


def detect(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template implies: Harmony's channels are gpt-oss's
    (`openai_gptoss`); one that closes `</think>` blocks is a thinking model's (`qwen3`: the
    output's own `<think>` or the prompt's decides); else None."""
    if chat_template and "<|channel|>analysis" in chat_template:
        return HarmonyReasoningParser.name
    if chat_template and ReasoningParser.END in chat_template:
        return Qwen3ReasoningParser.name
    return None


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str  # new reasoning text ("" if none)
    content: str  # new content text


class ReasoningStream:
    """Feed the generated text delta by delta; each `feed` returns the reasoning and content text
    that became certain (a partial marker and the newlines around the block are held back)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self._parser = parser
        self._in_reasoning = in_reasoning
        self._text = ""
        self._reasoning_sent: int | None = None  # absolute end of the reasoning sent
        self._content_sent: int | None = None

    @property
    def reasoning_started(self) -> bool:
        return self._reasoning_sent is not None

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._diff(final=False)

    def finish(self) -> ReasoningDelta:
        return self._diff(final=True)

    def _diff(self, final: bool) -> ReasoningDelta:
        text = self._text
        scan = self._parser._scan(text, self._in_reasoning, final)
        reasoning = content = ""
        if scan.has_reasoning:
            # The newlines after "<think>" move the start until the first other character.
            sent = max(scan.start, self._reasoning_sent or 0)
            reasoning = text[sent:scan.end]
            self._reasoning_sent = max(sent, scan.end)
        if scan.content is not None:
            sent = max(scan.content, self._content_sent or 0)
            content = text[sent:]
            self._content_sent = len(text)
        return ReasoningDelta(reasoning, content)


class HarmonyReasoningStream(ReasoningStream):
    """ReasoningStream over Harmony: each feed returns what the whole text's `parts` added
    since (both only grow as text comes)."""

    def __init__(self, parser: HarmonyReasoningParser):
        super().__init__(parser, in_reasoning=False)
        self._sent = ("", "")

    @property
    def reasoning_started(self) -> bool:
        return bool(self._sent[0])

    def _diff(self, final: bool) -> ReasoningDelta:
        reasoning, content = self._parser.parts(self._text, final)
        new = [now[len(sent):] if now.startswith(sent) else ""
               for now, sent in zip((reasoning or "", content), self._sent)]
        self._sent = tuple(sent + add for sent, add in zip(self._sent, new))
        return ReasoningDelta(*new)
