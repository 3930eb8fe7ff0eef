"""Every API request body as a pydantic model: what the parser checks and what GET /openapi.json
describes are the same definitions.

Strict types (no "1" for 1, no 1.5 for an int) and unknown fields refused ("Unrecognized request
argument supplied"). The request limits (RequestLimits) are part of the types, so the models of a
server are built from its limits by `request_models(limits)`. What depends on more than the body
(prompt + max_tokens against the context, token ids against the vocabulary, sampling ranges that
SamplingParams owns) is checked after parsing.

Known OpenAI fields we do not implement are typed to accept only their neutral value and marked
`x-neutral` (the error then says "not supported"); a field implemented later replaces its neutral
type here. Structured outputs and tools are typed here for their shape; what they mean (one
constraint out of response_format / structured_outputs / guided_*, the tool names, the schemas
the grammar library can enforce) is checked by `jaxserve.entrypoints.serving.structured_fields`,
`jaxserve.tool_calling` and the engine's grammar compiler.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator,
                      Field, Tag, model_validator)
from pydantic_core import PydanticCustomError

from jaxserve.agents.mcp_tools import MAX_SCHEMA_BYTES
from jaxserve.config import RequestLimits, SpeculativeConfig
from jaxserve.errors import InvalidRequest
from jaxserve.rag.config import SEARCH_MODES
from jaxserve.tokenizer import check_template_kwargs
from jaxserve.tool_calling.functions import MAX_TOOLS

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
MAX_RERANK_DOCUMENTS = 1000  # Cohere's recommended maximum per request


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def neutral(accepted: str) -> Any:
    """A field accepted only at its neutral value (or absent / null)."""
    return Field(None, description=f"Not supported: accepted only as {accepted}.",
                 json_schema_extra={"x-neutral": accepted})


def _integral(value: Any) -> Any:
    # JSON has one number type, and JSON Schema's "integer" includes 2.0: so does the parser
    # (a bool is never an integer; 1.5 stays an error).
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


def int_in(ge: int | None = None, le: int | None = None) -> Any:
    """An Int within bounds (the bounds go on the int itself, so the schema says minimum and
    maximum)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


# Prompt-cache TTLs (cache_pins.TTL_SECONDS): Anthropic's two and OpenAI's default; OpenAI's
# "12h" is refused (a pin outlives no hour here: docs/serving.md).
CacheTTL = Literal["5m", "30m", "1h"]


class PromptCacheBreakpoint(Body):
    """OpenAI's explicit breakpoint on a text part: the prompt through this part is pinned in the
    prefix cache for `ttl` (default: prompt_cache_options.ttl, else 5 minutes)."""

    mode: Literal["explicit"]
    ttl: CacheTTL | None = None


class PromptCacheOptions(Body):
    mode: Literal["implicit", "explicit"] | None = Field(None, description=(
        "Accepted; the automatic prefix cache serves both modes (it never changes an output) and "
        "only explicit breakpoints pin."))
    ttl: CacheTTL | None = Field(None, description="The breakpoints' default TTL (default 5m).")


class TextPart(Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ToolCallFunction(Body):
    name: NonEmptyStr
    arguments: str = Field(description="The arguments object as JSON text.")


class MessageToolCall(Body):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="A string, or text parts joined in order; may be null only on an "
                          "assistant message with `tool_calls`.")
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="An assistant message's calls (earlier turns of an agent loop).")
    tool_call_id: str | None = Field(None, description="A `tool` message: the call it answers.")
    reasoning_content: str | None = Field(
        None, description="An assistant message's reasoning, as a thinking model's earlier "
                          "answer returned it (its chat template decides whether it is shown).")

    @model_validator(mode="after")
    def _shape(self):
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise InvalidRequest(f"'{name}' is only allowed on assistant messages",
                                     param="messages")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise InvalidRequest("a 'tool' message needs 'tool_call_id' (and only it may have "
                                 "one)", param="messages")
        if self.content is None and not self.tool_calls:
            raise InvalidRequest("'content' is required (it may be null only on an assistant "
                                 "message with 'tool_calls')", param="messages")
        return self


class StreamOptions(Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's extension: with include_usage, usage on every chunk.")


class RagOption(Body):
    """jaxserve's retrieval-augmented chat: search `collection` for the last user message."""

    collection: NonEmptyStr
    top_k: Int | None = None
    mode: Literal[SEARCH_MODES] | None = None
    rerank: bool | None = None


class ResponseFormatText(Body):
    type: Literal["text"]


class ResponseFormatJsonObject(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="The JSON schema (absent: any object).")
    strict: bool | None = Field(None, description=(
        "The schema is always enforced; true also closes every object that does not say "
        "additionalProperties (OpenAI's strict mode)."))


class ResponseFormatJsonSchema(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def by_type(*models: type[Body]) -> Any:
    """A union of models told apart by their `type` literal. The tags are the class names, not
    the `type` values: an error's location holds the tag, and a value such as "json_schema" would
    read as the field of that name."""
    tags = {m.model_fields["type"].annotation.__args__[0]: m.__name__ for m in models}

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    return Annotated[Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)],
                     Discriminator(tag, custom_error_type="invalid_type", custom_error_message=(
                         f"'type' must be one of {', '.join(map(repr, tags))}"))]


ResponseFormat = by_type(ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema)


class StructuredOutputsField(Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                               description="A JSON schema (object or its text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="Lark (llguidance's dialect) or GBNF.")
    json_object: bool | None = None


class FunctionDefinition(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments "
                                                                "object; enforced when the call "
                                                                "is forced by tool_choice.")
    strict: bool | None = Field(None, description="True: a forced call's arguments have every "
                                                  "object that does not say "
                                                  "additionalProperties closed.")


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class _Structured(Body):
    """Structured outputs: vLLM's fields, on chat and completions."""

    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="Older vLLM name of "
                                                                        "structured_outputs.json.")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class _Unsupported(Body):
    """Known OpenAI fields this server does not implement, at their neutral value only."""

    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = neutral("{}")
    functions: Annotated[list[Any], Field(max_length=0)] | None = neutral("[]")
    function_call: Literal["none"] | None = neutral('"none"')
    store: Literal[False] | None = neutral("false")
    suffix: Literal[""] | None = neutral('""')
    service_tier: None = neutral("null")
    metadata: None = neutral("null")
    modalities: None = neutral("null")
    audio: None = neutral("null")
    prediction: None = neutral("null")
    reasoning_effort: None = neutral("null")
    web_search_options: None = neutral("null")
    user: str | None = Field(None, max_length=256, description=(
        "An opaque end-user id; a route with sticky = \"user\" keeps one user on one version."))


# ---- POST /v1/responses: the subset agents use (entrypoints/serving/responses.py) ----------------


class InputTextPart(Body):
    type: Literal["input_text", "output_text"]
    text: str
    # What an earlier response's output_text carried, when a client replays it as input.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class _Item(Body):
    # What an earlier response's output item carried, when a client replays it as input.
    id: str | None = None
    status: str | None = None


class InputMessage(_Item):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(_Item):
    """An earlier call of the model, replayed."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str


class FunctionCallOutputItem(_Item):
    """A tool's result: the answer to the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str


class McpApprovalResponseItem(_Item):
    """The user's answer to an `mcp_approval_request` of the previous response (agents/
    mcp_tools.py): approved, the call is made."""

    type: Literal["mcp_approval_response"]
    approval_request_id: Annotated[str, Field(min_length=1, max_length=128)]
    approve: bool
    reason: Annotated[str, Field(max_length=1024)] | None = None


# The MCP items of an earlier response, sent back by a client that keeps its own history
# (agents/mcp_tools.py reads them as it reads the previous_response_id chain's).
McpItemId = Annotated[str, Field(min_length=1, max_length=128)]
McpLabel = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
McpToolName = Annotated[str, Field(min_length=1, max_length=128)]
# An output or error text: this server's items keep 32,768 characters of a call's output.
McpText = Annotated[str, Field(max_length=1 << 16)]


def _json_object_text(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise PydanticCustomError("json_object", "must be a JSON object, as text")
    return text


# A call's arguments: what the chat path reads back as the model's call (JSON object text).
McpArguments = Annotated[str, Field(max_length=1 << 16), AfterValidator(_json_object_text)]


def _small_schema(schema: dict) -> dict:
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise PydanticCustomError("too_large", f"an input schema of at most {MAX_SCHEMA_BYTES} "
                                               f"bytes of JSON")
    return schema


class McpListedTool(Body):
    name: McpToolName
    description: Annotated[str, Field(max_length=1024)] | None = None
    input_schema: Annotated[dict[str, Any], AfterValidator(_small_schema)]
    annotations: dict[str, Any] | None = None


class McpListToolsItem(Body):
    """A server's tools listed before: the run offers them instead of listing again."""

    type: Literal["mcp_list_tools"]
    id: McpItemId
    server_label: McpLabel
    tools: Annotated[list[McpListedTool], Field(max_length=64)]
    error: McpText | None = None
    status: Literal["in_progress", "completed", "failed"] | None = None


class McpErrorContent(Body):
    type: Annotated[str, Field(max_length=64)]
    text: McpText | None = None


class McpCallError(Body):
    """OpenAI's error of a failed call: {type: mcp_tool_execution_error, content} or
    {type: mcp_protocol_error | http_error, code, message}."""

    type: Annotated[str, Field(max_length=64)]
    code: int | None = None
    message: McpText | None = None
    content: Annotated[list[McpErrorContent], Field(max_length=16)] | None = None


class McpCallItem(Body):
    """A call made before: the model reads its output (or error); an approval it answers is
    not made again."""

    type: Literal["mcp_call"]
    id: McpItemId
    server_label: McpLabel
    name: McpToolName
    arguments: McpArguments
    output: McpText | None = None
    error: McpText | McpCallError | None = None
    approval_request_id: McpItemId | None = None
    status: Literal["in_progress", "calling", "completed", "incomplete", "failed"] | None = None


class McpApprovalRequestItem(Body):
    """A call waiting for approval: an mcp_approval_response after it may answer it."""

    type: Literal["mcp_approval_request"]
    id: McpItemId
    server_label: McpLabel
    name: McpToolName
    arguments: McpArguments


_ITEM_MODELS = {"message": InputMessage, None: InputMessage, "function_call": FunctionCallItem,
                "function_call_output": FunctionCallOutputItem,
                "mcp_list_tools": McpListToolsItem, "mcp_call": McpCallItem,
                "mcp_approval_request": McpApprovalRequestItem,
                "mcp_approval_response": McpApprovalResponseItem}


def _item_tag(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    model = _ITEM_MODELS.get(kind) if isinstance(kind, str | None) else None
    return None if model is None else model.__name__


InputItem = Annotated[Union[tuple(Annotated[m, Tag(m.__name__)]
                                  for m in dict.fromkeys(_ITEM_MODELS.values()))],
                      Discriminator(_item_tag, custom_error_type="invalid_type",
                                    custom_error_message="an input item's 'type' must be "
                                    "'message', 'function_call', 'function_call_output', "
                                    "'mcp_list_tools', 'mcp_call', 'mcp_approval_request' or "
                                    "'mcp_approval_response'")]


class ResponsesFunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesFileSearchTool(Body):
    """A server-side tool (agents/file_search.py): the tenant's retrieval collections named by
    `vector_store_ids` are searched for the model's query."""

    type: Literal["file_search"]
    vector_store_ids: Annotated[list[Annotated[str, Field(min_length=1, max_length=128)]],
                                Field(min_length=1, max_length=16)]
    max_num_results: Annotated[Int, Field(ge=1, le=50)] | None = None


class CodeInterpreterContainer(Body):
    type: Literal["auto"]  # a fresh sandbox per call; named, persistent containers: not served


class ResponsesCodeInterpreterTool(Body):
    """A server-side tool (agents/code_interpreter.py): the model's Python run in a sandbox."""

    type: Literal["code_interpreter"]
    container: CodeInterpreterContainer


McpName = Annotated[str, Field(min_length=1, max_length=128)]
# OpenAI's metadata: up to 16 keys of at most 64 characters, values of at most 512.
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ConversationRef(Body):
    id: Annotated[str, Field(min_length=1, max_length=128)]


class ConversationCreate(Body):
    """POST /v1/conversations (agents/conversations.py)."""

    items: Annotated[list[InputItem], Field(max_length=20)] | None = None
    metadata: Metadata | None = None


class ConversationUpdate(Body):
    metadata: Metadata


class ConversationItemsAdd(Body):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=20)]


class McpToolFilter(Body):
    tool_names: Annotated[list[McpName], Field(max_length=64)] | None = None
    read_only: bool | None = Field(None, description="Only the tools the server marks "
                                                     "readOnlyHint.")


class McpApprovalFilter(Body):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$"  # an HTTP token


def _no_connector(value: Any) -> None:
    if value is not None:
        raise PydanticCustomError("unsupported", "connectors are not served here: give the MCP "
                                                 "server's server_url")


class ResponsesMcpTool(Body):
    """A server-side tool (agents/mcp_tools.py): a remote MCP server's tools, on a host the
    operator allows (--mcp-allowed-hosts)."""

    type: Literal["mcp"]
    server_label: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    # Before server_url: a request naming a connector is told that, not that server_url is missing.
    connector_id: Annotated[str | None, AfterValidator(_no_connector)] = Field(
        None, description="Not served (no connectors here): a 400.")
    server_url: Annotated[str, Field(min_length=1, max_length=2048)]
    server_description: Annotated[str, Field(max_length=1024)] | None = Field(
        None, description="Offered to the model with the server's tools.")
    authorization: Annotated[str, Field(min_length=1, max_length=8192,
                                        pattern=r"^[^\r\n\x00]*$")] | None = Field(
        None, description="An OAuth access token, sent to the server as `Authorization: Bearer "
                          "<token>`; never echoed or stored.")
    allowed_tools: Annotated[list[McpName], Field(max_length=64)] | McpToolFilter | None = None
    require_approval: (Literal["always", "never"] | McpApprovalFilter | None) = Field(
        None, description="Default \"always\", as OpenAI's.")
    headers: Annotated[dict[Annotated[str, Field(pattern=_HEADER_NAME)],
                            Annotated[str, Field(max_length=8192, pattern=r"^[^\r\n\x00]*$")]],
                       Field(max_length=16)] | None = Field(
        None, description="Sent to the server with each request; not echoed in the response.")


class ResponsesMcpChoice(Body):
    type: Literal["mcp"]
    server_label: Annotated[str, Field(min_length=1, max_length=64)]
    name: McpName  # required here: the chat path forces one function


class ResponsesNamedToolChoice(Body):
    type: Literal["function"]
    name: str


class ResponsesHostedToolChoice(Body):
    type: Literal["file_search"]


class ResponsesCodeInterpreterChoice(Body):
    type: Literal["code_interpreter"]


class TextFormatText(Body):
    type: Literal["text"]


class TextFormatJsonObject(Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(Body):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextOptions(Body):
    format: by_type(TextFormatText, TextFormatJsonObject, TextFormatJsonSchema) | None = None


@dataclass(frozen=True)
class RequestModels:
    chat: type[Body]
    completion: type[Body]
    tokenize: type[Body]
    responses: type[Body]


# /tokenize and /detokenize answer on the event loop: their inputs stay small enough to take
# milliseconds (a longer prompt cannot be a prompt: max_model_len tokens are far fewer).
MAX_TOKENIZE_CHARS = 1 << 20
MAX_DETOKENIZE_TOKENS = 1 << 17


def _no_streamed_prompt_logprobs(body) -> None:
    # As vLLM: prompt_logprobs come whole, in a non-streamed response.
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequest("'prompt_logprobs' is not available with 'stream': true",
                             param="prompt_logprobs")


@functools.cache
def request_models(limits: RequestLimits = RequestLimits()) -> RequestModels:
    """The generation request models under `limits` (one set per limits value)."""
    stop_str = Annotated[str, Field(min_length=1, max_length=limits.max_stop_length)]
    top_n = int_in(0, limits.max_logprobs)
    message_list = Annotated[list[ChatMessage],
                             Field(min_length=1, max_length=limits.max_messages)]
    few = Field(min_length=1, max_length=limits.max_prompts)

    class _Generation(_Structured, _Unsupported):
        model: NonEmptyStr
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        stop: stop_str | Annotated[list[stop_str], Field(max_length=limits.max_stop)] | None = None
        max_tokens: Int | None = None
        n: int_in(le=limits.max_n) | None = None
        best_of: int_in(le=limits.max_n) | None = Field(
            None, description="Only 1 or `n` (both mean: return every sequence).")
        temperature: float | None = None
        top_p: float | None = None
        seed: Int | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        # vLLM's extras
        top_k: Int | None = None
        min_p: float | None = None
        repetition_penalty: float | None = None
        ignore_eos: bool | None = None
        min_tokens: Int | None = None
        stop_token_ids: list[Int] | None = None
        skip_special_tokens: bool | None = None
        include_stop_str_in_output: bool | None = None
        num_speculative_tokens: int_in(0, SpeculativeConfig.MAX_SPECULATIVE_TOKENS) | None = Field(
            None, description="On a server with speculative decoding: at most this many draft "
                              "tokens per step for this request (0 opts out; more than the "
                              "server's K means K). Ignored without speculation.")

        @model_validator(mode="after")
        def _combinations(self):
            if self.stream_options is not None and not self.stream:
                raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                                     param="stream_options")
            if self.best_of not in (None, 1, self.n or 1):
                raise InvalidRequest("'best_of' is not supported by this server (only 1 or n "
                                     "is accepted)", param="best_of")
            return self

    class ChatCompletionRequest(_Generation):
        messages: message_list
        max_completion_tokens: Int | None = Field(None, description="Wins over `max_tokens`.")
        logprobs: bool | None = None
        top_logprobs: top_n | None = None
        prompt_logprobs: top_n | None = Field(
            None, description="vLLM's extension: each prompt token's logprob, rank and the top n "
                              "(the response's `prompt_logprobs`; not with `stream`).")
        rag: RagOption | None = None
        response_format: ResponseFormat | None = None
        tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
        parallel_tool_calls: bool | None = Field(
            None, description="With tool_choice 'required': one or more calls (default true).")
        chat_template_kwargs: dict[str, Any] | None = Field(
            None, description="vLLM's extension: more variables for the model's chat template, "
                              "such as Qwen3's `enable_thinking` (at most 32, identifiers, 16 KiB "
                              "of JSON; not the ones the server sets).")
        prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
            None, description="OpenAI's cache-locality key: a route with sticky = \"user\" "
                              "keeps one key on one version (it wins over `user` there).")
        prompt_cache_options: PromptCacheOptions | None = None

        @model_validator(mode="after")
        def _top_logprobs(self):
            if self.top_logprobs is not None and not self.logprobs:
                raise InvalidRequest("'top_logprobs' requires 'logprobs': true",
                                     param="top_logprobs")
            _no_streamed_prompt_logprobs(self)
            if self.chat_template_kwargs is not None:
                check_template_kwargs(self.chat_template_kwargs)
            return self

    class CompletionRequest(_Generation):
        prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], few]
                 | Annotated[list[Int], Field(min_length=1)]
                 | Annotated[list[Annotated[list[Int], Field(min_length=1)]], few]) = Field(
            description="A string, a list of strings, a list of token ids, or a list of such "
                        "lists (each prompt gets `n` choices).")
        echo: bool | None = Field(None, description="Put the prompt before each choice's "
                                                    "text; with `logprobs`, its tokens' logprobs "
                                                    "before the generated ones (the first null). "
                                                    "`max_tokens` 0 then scores the prompt "
                                                    "without generating.")
        logprobs: top_n | None = None
        prompt_logprobs: top_n | None = Field(
            None, description="vLLM's extension: each prompt token's logprob, rank and the top n "
                              "(each choice's `prompt_logprobs`; not with `stream`).")

        @model_validator(mode="after")
        def _echo(self):
            if self.max_tokens == 0 and not self.echo:
                raise InvalidRequest("'max_tokens' 0 (score the prompt only) needs 'echo': true",
                                     param="max_tokens")
            _no_streamed_prompt_logprobs(self)
            return self

    class TokenizeRequest(Body):
        model: str | None = None
        prompt: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | None = None
        messages: message_list | None = None
        add_special_tokens: bool | None = None
        add_generation_prompt: bool | None = Field(None, description="With `messages` (default "
                                                                     "true).")
        return_token_strs: bool | None = Field(None, description="Each token's text too.")

    class ResponsesRequest(Body):
        """Stored by default (`store`), chained (`previous_response_id`), run in the background
        (`background`); server tools (`file_search`, `code_interpreter`, `mcp`) beside the
        client's functions."""

        model: NonEmptyStr
        input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1,
                                                              max_length=limits.max_messages)]
        instructions: str | None = Field(None, description="A system message put first.")
        max_output_tokens: Int | None = None
        temperature: float | None = None
        top_p: float | None = None
        tools: Annotated[list[by_type(ResponsesFunctionTool, ResponsesFileSearchTool,
                                      ResponsesCodeInterpreterTool, ResponsesMcpTool)],
                         Field(max_length=MAX_TOOLS)] | None = None
        tool_choice: (Literal["none", "auto", "required"]
                      | by_type(ResponsesNamedToolChoice, ResponsesHostedToolChoice,
                                ResponsesCodeInterpreterChoice, ResponsesMcpChoice)
                      | None) = None
        max_tool_calls: Annotated[Int, Field(ge=1, le=128)] | None = None
        parallel_tool_calls: bool | None = None
        text: TextOptions | None = None
        stream: bool | None = None
        store: bool | None = Field(None, description="Keep the response (default true).")
        previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
        conversation: (Annotated[str, Field(min_length=1, max_length=128)] | ConversationRef
                       | None) = Field(None, description="A conversation (/v1/conversations): "
                                       "its items are the history; the response's input and "
                                       "output are added to it.")
        background: bool | None = None
        include: Annotated[list[str], Field(max_length=0)] | None = neutral("[]")
        truncation: Literal["disabled"] | None = neutral('"disabled"')
        reasoning: None = neutral("null")
        metadata: None = neutral("null")
        service_tier: None = neutral("null")
        user: str | None = Field(None, description="An opaque end-user id; not used.")
        prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
            None, description="As on chat completions.")
        prompt_cache_options: PromptCacheOptions | None = None

        @model_validator(mode="after")
        def _storage(self):
            if self.background and self.store is False:
                raise InvalidRequest("'background': true needs the response stored (leave "
                                     "'store' out or send true)", param="background")
            if self.conversation is not None and self.previous_response_id is not None:
                raise InvalidRequest("'conversation' and 'previous_response_id' cannot both be "
                                     "given", param="conversation")
            return self

        @property
        def conversation_id(self) -> str | None:
            return self.conversation if isinstance(self.conversation, str | None) \
                else self.conversation.id

    return RequestModels(ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                         ResponsesRequest)


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: Annotated[list[Int], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class EmbeddingRequest(Body):
    """HTTP /v1/embeddings and gRPC Embed alike: 1 to 2048 strings, none empty."""

    model: str
    input: NonEmptyStr | Annotated[list[NonEmptyStr],
                                   Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Int | None = None
    user: str | None = None


def embedding_texts(body: EmbeddingRequest) -> list[str]:
    return [body.input] if isinstance(body.input, str) else body.input


class CreateCollectionRequest(Body):
    name: str


class DocumentIn(Body):
    id: NonEmptyStr
    text: str
    metadata: dict[str, Any] | None = None


class UpsertDocumentsRequest(Body):
    documents: Annotated[list[DocumentIn], Field(min_length=1)]


class SearchRequest(Body):
    query: str
    top_k: Int | None = None
    mode: Literal[SEARCH_MODES] | None = None
    rerank: bool | None = Field(None, description="Order the hits by the late-interaction "
                                                  "reranker.")


class RerankDocument(Body):
    text: NonEmptyStr


class RerankRequest(Body):
    model: str | None = None
    query: str
    documents: Annotated[list[NonEmptyStr | RerankDocument],
                         Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: Int | None = Field(None, description="How many of the best to return; 0 or absent: all.")
    return_documents: bool | None = None
    user: str | None = None
