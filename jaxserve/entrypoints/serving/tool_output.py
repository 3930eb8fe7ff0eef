"""A chat choice's generated text -> OpenAI's assistant message: its `reasoning_content` (a
thinking model's reasoning), `content` and `tool_calls`, whole or as stream deltas.

The reasoning parser (`--reasoning-parser`, jaxserve.reasoning.parsers) takes the reasoning off
first; what follows it is content, which the tool-call parser (`--tool-call-parser`,
jaxserve.tool_calling.parsers) reads when the request has tools (and tool_choice is not "none").
A choice that made calls and ended on its own ("stop") finishes with "tool_calls"; one cut by
max_tokens keeps "length" and its unfinished call, arguments as far as they were written (as
OpenAI returns it, and as the stream announced it). Streaming runs one stream of each parser per
choice, so the deltas join to what the whole-text parse returns.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.reasoning import parsers as reasoning_parsers
from jaxserve.reasoning.parsers import ReasoningParser, ReasoningStream
from jaxserve.tool_calling import parsers as tool_parsers
from jaxserve.tool_calling.parsers import ToolCallStream, ToolParser

AUTO, NONE = "auto", "none"
# The prompt's last tokens, decoded, tell whether the template left a reasoning block open.
_PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class OutputParsers:
    """A served model's parsers: tool calls (a request with tools uses it), and reasoning or
    None. `reasoning_needs_special_tokens`: its markers are special tokens of the vocabulary, so a
    request it parses keeps special tokens in its text."""

    tool: ToolParser
    reasoning: ReasoningParser | None
    reasoning_needs_special_tokens: bool = False


def check_parser_names(tool_call_parser: str, reasoning_parser: str) -> None:
    """ConfigError at start for a name no parser has."""
    if tool_call_parser != AUTO:
        tool_parsers.get_tool_parser(tool_call_parser)
    if reasoning_parser not in (AUTO, NONE):
        reasoning_parsers.get_reasoning_parser(reasoning_parser)


class ParserChoice:
    """`--tool-call-parser` / `--reasoning-parser` per served tokenizer: a name, or "auto" (from
    the model's chat template: jaxserve.tool_calling.parsers.detect,
    jaxserve.reasoning.parsers.detect), or for reasoning "none". Resolved once per tokenizer."""

    def __init__(self, tool_call_parser: str = AUTO, reasoning_parser: str = AUTO):
        check_parser_names(tool_call_parser, reasoning_parser)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._resolved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def for_tokenizer(self, tokenizer) -> OutputParsers:
        parsers = self._resolved.get(tokenizer)
        if parsers is None:
            parsers = self._resolved[tokenizer] = self._resolve(tokenizer)
        return parsers

    def _resolve(self, tokenizer) -> OutputParsers:
        template = tokenizer.chat_template
        tool = self.tool_call_parser
        tool = tool_parsers.detect(template) if tool == AUTO else tool
        reasoning = self.reasoning_parser
        reasoning = reasoning_parsers.detect(template) if reasoning == AUTO else reasoning
        if reasoning in (None, NONE):
            return OutputParsers(tool_parsers.get_tool_parser(tool), None)
        parser = reasoning_parsers.get_reasoning_parser(reasoning)
        special = set(tokenizer.all_special_ids)
        markers = [tokenizer.encode(m, add_special_tokens=False) for m in (parser.START,
                                                                          parser.END)]
        return OutputParsers(tool_parsers.get_tool_parser(tool), parser,
                             any(len(ids) == 1 and ids[0] in special for ids in markers))


def _finish_reason(made_calls: bool, finish: str | None) -> str | None:
    return "tool_calls" if made_calls and finish == "stop" else finish


class ToolCallOutput:
    """One request's output assembly. `parser` None: no tool calls, the content is as it is;
    `reasoning` None: no reasoning parsed. `in_reasoning`: the prompt left the model inside its
    reasoning block (ReasoningParser.starts_in_reasoning)."""

    def __init__(self, parser: ToolParser | None, reasoning: ReasoningParser | None = None,
                 in_reasoning: bool = False):
        self.parser = parser
        self.reasoning = reasoning
        self.in_reasoning = in_reasoning
        self._streams: dict[int, ToolCallStream] = {}
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def after_prompt(self, tokenizer, prompt_ids, params: SamplingParams
                     ) -> tuple[ToolCallOutput, SamplingParams]:
        """This output and the sampling params for a chat whose prompt is `prompt_ids`: whether
        the template left the model inside a reasoning block is read from the prompt's last
        tokens, and a structured-output constraint then holds after the block, as in vLLM
        (the model thinks freely first; StructuredOutputsParams.after_reasoning)."""
        if self.reasoning is None:
            return self, params
        tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        opened = self.reasoning.starts_in_reasoning(tail)
        constraint = params.structured_outputs
        if constraint is not None:
            params = params.replace(structured_outputs=constraint.after_reasoning(
                self.reasoning.grammar(opened)))
        return ToolCallOutput(self.parser, self.reasoning, opened), params

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish_reason) of a finished choice."""
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, in_reasoning=self.in_reasoning)
            reasoning, text = split.reasoning, split.content
        message: dict = {"role": "assistant", "content": text}
        calls = []
        if self.parser is not None:
            parsed = self.parser.parse(text, cut=finish == "length")
            message["content"], calls = parsed.content, parsed.tool_calls
        if reasoning is not None:
            message["reasoning_content"] = reasoning
            message["content"] = message["content"] or None
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, _finish_reason(bool(calls), finish)

    def delta(self, choice: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the chunk's delta, the finish_reason) for new text of a streamed choice. The delta
        is empty while text that can still become a marker or a call is held back."""
        delta: dict = {}
        if self.reasoning is not None:
            stream = self._reasoning_streams.get(choice)
            if stream is None:
                stream = self._reasoning_streams[choice] = self.reasoning.stream(
                    in_reasoning=self.in_reasoning)
            parts = [stream.feed(text)] + ([stream.finish()] if finish is not None else [])
            reasoning = "".join(p.reasoning for p in parts)
            if reasoning:
                delta["reasoning_content"] = reasoning
            text = "".join(p.content for p in parts)
        if self.parser is None:
            if text or (not finish and self.reasoning is None):  # as the engine sent it
                delta["content"] = text
            return delta, finish
        stream = self._streams.get(choice)
        if stream is None:
            stream = self._streams[choice] = self.parser.stream()
        parts = [stream.feed(text)] + ([stream.finish()] if finish is not None else [])
        content = "".join(p.content for p in parts)
        calls = [c for p in parts for c in p.tool_calls]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, _finish_reason(stream.tool_calls_started, finish)
