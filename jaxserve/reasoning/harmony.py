"""gpt-oss's Harmony output, read as text: the messages a completion holds, each a header (its
channel, its recipient) and a body.

After the chat template's generation prompt (`<|start|>assistant`) the model writes messages such
as

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 18C in Paris.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
        {"city": "Paris"}<|call|>

(a recipient may also stand before the channel: `<|start|>assistant to=functions.get_weather
<|channel|>commentary json<|message|>`). `analysis` is reasoning, `final` the answer, and a
message with a `functions.NAME` recipient a tool call whose body is the arguments' JSON;
`commentary` without one is a preamble to the user. The markers are special tokens of gpt-oss's
vocabulary, so the text keeps special tokens; a message ends at `<|end|>`, `<|call|>`,
`<|return|>` or the next `<|start|>` (stop tokens are not in the text). Text before any header is
plain (a model that does not write Harmony).

Read by the `openai_gptoss` reasoning parser (jaxserve.reasoning.parsers) and the `openai` tool
parser (jaxserve.tool_calling.parsers), vLLM's names for gpt-oss. Written by hand over text, not
with the `openai-harmony` package: that package parses token ids of its own o200k vocabulary
(downloaded at first use), where jaxserve's parsers see the detokenized text of any vocabulary.
Pure Python: no JAX, no engine.
"""

from __future__ import annotations

import re
from typing import NamedTuple

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class Message(NamedTuple):
    """A message of the text, perhaps still being written. `channel` None: plain text outside
    any header. body is text[start:end]."""

    channel: str | None
    recipient: str | None
    start: int
    end: int
    complete: bool

    @property
    def function(self) -> str | None:
        """The function a tool-call message calls, or None."""
        r = self.recipient or ""
        return r[len(FUNCTIONS):] if r.startswith(FUNCTIONS) and len(r) > len(FUNCTIONS) else None


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text may begin one of `markers`."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def call_text(function: str, arguments: str, complete: bool) -> str:
    """A tool-call message in one header form (what the reasoning parser passes on)."""
    return (f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{function}{MESSAGE}{arguments}"
            + ("<|call|>" if complete else ""))


def _is_header(text: str, pos: int) -> bool:
    # (A recipient first only right after the prompt's `<|start|>assistant`.)
    return text.startswith((START, CHANNEL), pos) or (pos == 0 and text.startswith(
        (" to=", "to="), pos))


def messages(text: str, final: bool) -> list[Message]:
    """The messages of `text` as far as they are certain: while streaming (`final` False) a tail
    that may begin a marker is held back, and a header counts once its `<|message|>` is in.
    Text outside any header (before the first; after a message, up to the next header: JSON a
    constraint made the model write after its analysis) is a plain Message."""
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        if not _is_header(text, pos):
            rest = text[pos:]
            if not final and any(h.startswith(rest) for h in (START, CHANNEL, " to=")):
                break  # undecided: the start of a header, or plain text
            nxt = min((i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i >= 0),
                      default=-1)
            if nxt < 0:
                end = len(text) if final else len(text) - _held_back(rest, (START, CHANNEL))
                out.append(Message(None, None, pos, end, final))
                break
            out.append(Message(None, None, pos, nxt, True))
            pos = nxt
        if text.startswith(START, pos):
            pos += len(START)
        at = text.find(MESSAGE, pos)
        if at < 0:
            break  # a header still being written (or, at the end, one that never was finished)
        header = text[pos:at]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        start = at + len(MESSAGE)
        found = [(i, m) for m in ENDS if (i := text.find(m, start)) >= 0]
        channel = channel.group(1) if channel else ""
        recipient = recipient.group(1) if recipient else None
        if not found:
            end = len(text) if final else len(text) - _held_back(text[start:], ENDS)
            out.append(Message(channel, recipient, start, end, False))
            break
        end, marker = min(found)
        out.append(Message(channel, recipient, start, end, True))
        pos = end if marker == START else end + len(marker)
    return out
