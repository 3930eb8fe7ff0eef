"""Anthropic's Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens) as
pydantic models, under the server's RequestLimits like the OpenAI ones (request_models.py: the
same strictness, unknown fields refused).

What has no meaning here is refused by its type, naming the field: image and document blocks
(text-only models), `redacted_thinking` (we never redact), server tools (a tool with a `type`).
`cache_control` is accepted on the blocks and tools Anthropic allows it on: a breakpoint pins its
prompt prefix in the prefix cache for its TTL (anthropic.cache_breakpoints, docs/anthropic.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from jaxserve.config import RequestLimits
from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.serving.request_models import Body, Int, NonEmptyStr, by_type, int_in
from jaxserve.tool_calling.functions import MAX_TOOLS

# Anthropic's own bound on an extended-thinking budget (and it must stay below max_tokens).
MIN_THINKING_BUDGET = 1024


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = Field(None, description="Not supported: only null.")


class DirectCaller(Body):
    type: Literal["direct"]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # What the client library writes back of an answer it got (only client tools are served).
    caller: DirectCaller | None = None
    toolset_name: None = Field(None, description="Not supported: only null.")


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool | None = Field(None, description="Said to the model as the result's text "
                                                    "(it has no other way to see it).")
    cache_control: CacheControl | None = None
    toolset_name: None = Field(None, description="Not supported: only null.")


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="Accepted and not checked: the thinking "
                                                    "goes back to the template as reasoning.")


UserBlock = by_type(TextBlock, ToolResultBlock)
AssistantBlock = by_type(TextBlock, ToolUseBlock, ThinkingBlock)


class UserMessage(Body):
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


def _by_role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return {"user": "UserMessage", "assistant": "AssistantMessage"}.get(role) \
        if isinstance(role, str) else None


Message = Annotated[Union[Annotated[UserMessage, Tag("UserMessage")],
                          Annotated[AssistantMessage, Tag("AssistantMessage")]],
                    Discriminator(_by_role, custom_error_type="invalid_role",
                                  custom_error_message="'role' must be 'user' or 'assistant' "
                                                       "(the system prompt is 'system')")]


class Tool(Body):
    """A client tool: its calls come back as tool_use blocks (Anthropic's server tools, which
    have a `type`, are not served)."""

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoiceAuto(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Body):
    type: Literal["tool"]
    name: NonEmptyStr
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Body):
    type: Literal["none"]


class ThinkingEnabled(Body):
    type: Literal["enabled"]
    budget_tokens: Int = Field(description=f"At least {MIN_THINKING_BUDGET} and below "
                                           "max_tokens, as Anthropic asks; max_tokens bounds the "
                                           "thinking and the answer together.")


class ThinkingDisabled(Body):
    type: Literal["disabled"]


class ThinkingAdaptive(Body):
    """The model decides whether to think: a template that can think is asked to."""

    type: Literal["adaptive"]


class JsonSchemaOutput(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    format: JsonSchemaOutput | None = Field(None, description="Structured output: the text is "
                                                              "JSON of this schema.")


class Metadata(Body):
    user_id: Annotated[str, Field(max_length=256)] | None = None


@dataclass(frozen=True)
class MessagesModels:
    messages: type[Body]
    count_tokens: type[Body]


@functools.cache
def messages_models(limits: RequestLimits = RequestLimits()) -> MessagesModels:
    """The Messages API request models under `limits` (one set per limits value)."""
    stop_str = Annotated[str, Field(min_length=1, max_length=limits.max_stop_length)]

    class _Prompt(Body):
        model: NonEmptyStr
        messages: Annotated[list[Message], Field(min_length=1, max_length=limits.max_messages)]
        system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
        tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
        tool_choice: by_type(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool,
                             ToolChoiceNone) | None = None
        thinking: by_type(ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive) | None = None
        output_config: OutputConfig | None = None
        cache_control: CacheControl | None = Field(None, description=(
            "Pins the whole prompt's prefix in the prefix cache for its ttl (5m or 1h)."))

        @model_validator(mode="after")
        def _tool_choice(self):
            if isinstance(self.tool_choice, ToolChoiceTool) and self.tool_choice.name not in {
                    t.name for t in self.tools or ()}:
                raise InvalidRequest(f"tool_choice names '{self.tool_choice.name}', which is "
                                     "not in 'tools'", param="tool_choice.name")
            if isinstance(self.tool_choice, (ToolChoiceAny, ToolChoiceTool)) and not self.tools:
                raise InvalidRequest("tool_choice 'any' or 'tool' needs 'tools'",
                                     param="tool_choice")
            return self

    class MessagesRequest(_Prompt):
        max_tokens: int_in(ge=1)
        stop_sequences: Annotated[list[stop_str], Field(max_length=limits.max_stop)] | None = None
        stream: bool | None = None
        temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
        top_k: int_in(ge=1) | None = None
        metadata: Metadata | None = None
        service_tier: Literal["auto", "standard_only"] | None = Field(
            None, description="Accepted; there is one tier.")

        @model_validator(mode="after")
        def _thinking_budget(self):
            if isinstance(self.thinking, ThinkingEnabled):
                budget = self.thinking.budget_tokens
                if not MIN_THINKING_BUDGET <= budget < self.max_tokens:
                    raise InvalidRequest(
                        f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET} and less than "
                        f"max_tokens ({self.max_tokens}), got {budget}",
                        param="thinking.budget_tokens")
            return self

    class CountTokensRequest(_Prompt):
        pass

    return MessagesModels(MessagesRequest, CountTokensRequest)


# ---- answers (for GET /openapi.json; the handlers build plain dicts) ---------------------------

class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextOut(_Reply):
    type: Literal["text"]
    text: str


class ThinkingOut(_Reply):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseOut(_Reply):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(_Reply):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens read from the prefix cache.")


class MessageOut(_Reply):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal",
                         "abort"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageEvent(_Reply):
    """One event of a streamed message (the SSE `event:` line repeats `type`): message_start,
    content_block_start / _delta / _stop, message_delta, message_stop, error."""

    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicErrorDetail(_Reply):
    type: str
    message: str


class AnthropicError(_Reply):
    type: Literal["error"]
    error: AnthropicErrorDetail


class TokenCount(_Reply):
    input_tokens: int
