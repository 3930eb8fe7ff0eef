"""A chat choice's generated text -> OpenAI's assistant message with `tool_calls`, whole or as
stream deltas, when the request has tools (and tool_choice is not "none").

The model family's parser (`--tool-call-parser`, jaxserve.tool_calling.parsers) finds the calls. A
choice that made calls and ended on its own ("stop") finishes with "tool_calls"; one cut by
max_tokens keeps "length" and its unfinished call, arguments as far as they were written (as
OpenAI returns it, and as the stream announced it). Streaming
runs one ToolCallStream per choice, so the deltas join to what the whole-text parse returns.
"""

from __future__ import annotations

from jaxserve.tool_calling.parsers import ToolCallStream, ToolParser


def _finish_reason(made_calls: bool, finish: str | None) -> str | None:
    return "tool_calls" if made_calls and finish == "stop" else finish


class ToolCallOutput:
    """One request's tool-call assembly; `parser` None: the text is content as it is."""

    def __init__(self, parser: ToolParser | None):
        self.parser = parser
        self._streams: dict[int, ToolCallStream] = {}

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish_reason) of a finished choice."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish
        parsed = self.parser.parse(text, cut=finish == "length")
        message = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        return message, _finish_reason(bool(parsed.tool_calls), finish)

    def delta(self, choice: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the chunk's delta, the finish_reason) for new text of a streamed choice. The delta
        is empty while text that can still become a call is held back."""
        if self.parser is None:
            return ({"content": text} if text or not finish else {}), finish
        stream = self._streams.get(choice)
        if stream is None:
            stream = self._streams[choice] = self.parser.stream()
        parts = [stream.feed(text)]
        if finish is not None:
            parts.append(stream.finish())
        content = "".join(p.content for p in parts)
        calls = [c for p in parts for c in p.tool_calls]
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, _finish_reason(stream.tool_calls_started, finish)
