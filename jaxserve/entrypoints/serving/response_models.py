"""The shapes of the API's JSON answers, for GET /openapi.json.

The handlers build their bodies as plain dicts (a streamed chunk must not pay for a model); these
models describe them, and the schemathesis test in the suite checks every answer of a real server
against them, so a handler that drifts from its description fails there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "abort"] | None
Fingerprint = Annotated[str | None, Field(description=(
    "The answering model version's manifest id (null for a model served without one)"))]


class PromptTokensDetails(Reply):
    cached_tokens: int = Field(description="Prompt tokens read from the prefix cache.")


class Usage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Citation(Reply):
    document_id: str
    chunk_id: str  # "<document id>#<chunk index>"
    score: float


class TopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply):
    content: list[TokenLogprob]


class FunctionCall(Reply):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(Reply):
    id: str  # "call_" + 24 hex digits
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Reply):
    role: Literal["assistant"]
    content: str | None  # null when the whole answer is tool calls
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(Reply):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Reply):
    """A call's first delta has id, type and function.name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class PromptTokenLogprob(Reply):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token (the first null), token id -> its logprob.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class ChatChoice(Reply):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Reply):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: Fingerprint = None
    choices: list[ChatChoice]
    usage: Usage
    citations: list[Citation] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the request's `prompt_logprobs`


class ChatDelta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionChunk(Reply):
    """One `data:` event of a streamed chat completion. `usage` is present (null until the last,
    choice-less chunk) when `stream_options.include_usage` is set; on every chunk (the counts so
    far) with `continuous_usage_stats` too."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: Fingerprint = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    citations: list[Citation] | None = None


class CompletionLogprobs(Reply):
    """With `echo`, the prompt's tokens first: the very first one has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_logprobs: PromptLogprobs | None = None  # with the request's `prompt_logprobs`


class Completion(Reply):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: Fingerprint = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Reply):
    """One `data:` event of a streamed completion (`usage` as in ChatCompletionChunk)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: Fingerprint = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class RouteCard(Reply):
    weights: dict[str, float]
    sticky: Literal["user", "api_key", "none"]


class ModelCard(Reply):
    """A model version (with its context length and manifest id) or a route (with its
    versions' weights)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    system_fingerprint: str | None = None
    route: RouteCard | None = None


class ModelList(Reply):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(Reply):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with `return_token_strs`


class TokenizerInfo(Reply):
    """vLLM's /tokenizer_info: tokenizer_config.json's fields."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class Detokenized(Reply):
    prompt: str


class Status(Reply):
    """/health: "ok". /ready: "ready" (200), or "warming up", "engine stopped", "engine
    stalled", "shutting down" (503)."""

    status: str


class ErrorDetail(Reply):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Reply):
    error: ErrorDetail


class Embedding(Reply):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(Reply):
    prompt_tokens: int
    total_tokens: int


class Embeddings(Reply):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class CollectionInfo(Reply):
    name: str
    documents: int
    chunks: int
    index: str


class CollectionList(Reply):
    object: Literal["list"]
    data: list[CollectionInfo]


class CollectionDeleted(Reply):
    name: str
    deleted: Literal[True]


class DocumentsUpserted(Reply):
    collection: str
    documents: int
    chunks: int


class DocumentDeleted(Reply):
    id: str
    deleted: Literal[True]


class SearchHit(Reply):
    document_id: str
    chunk_id: str  # "<document id>#<chunk index>"
    text: str
    score: float
    metadata: dict[str, Any]
    start: int
    end: int


class SearchResults(Reply):
    results: list[SearchHit]


class RerankedText(Reply):
    text: str


class RerankResult(Reply):
    index: int
    relevance_score: float
    document: RerankedText | None = None  # left out with return_documents: false


class RerankUsage(Reply):
    total_tokens: int


class Reranked(Reply):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


# ---- POST /v1/responses (entrypoints/serving/responses.py) ---------------------------------------


class FileCitation(Reply):
    """Where an answer names a file that file_search returned (agents/file_search.citations)."""

    type: Literal["file_citation"]
    file_id: str
    filename: str
    index: int  # in the text, where a client inserts the citation


class OutputText(Reply):
    type: Literal["output_text"]
    text: str
    annotations: list[FileCitation]


class OutputMessage(Reply):
    type: Literal["message"]
    id: str  # "msg_..."
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(Reply):
    type: Literal["function_call"]
    id: str  # "fc_..."
    call_id: str  # "call_...": what a function_call_output answers
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFileSearchCall(Reply):
    type: Literal["file_search_call"]
    id: str  # "fi_..."
    queries: list[str]
    status: Literal["in_progress", "searching", "completed", "incomplete", "failed"]
    results: list[dict[str, Any]] | None


class OutputCodeInterpreterCall(Reply):
    type: Literal["code_interpreter_call"]
    id: str  # "co_..."
    code: str | None
    container_id: str | None  # None: a fresh sandbox per call
    status: Literal["in_progress", "interpreting", "completed", "incomplete", "failed"]
    outputs: list[dict[str, Any]] | None  # OpenAI's: [{"type": "logs", "logs": stdout}]
    result: dict[str, Any] | None  # this server's: exit_code, stdout, stderr, files


class OutputMcpListTools(Reply):
    type: Literal["mcp_list_tools"]
    id: str  # "mcpl_..."
    server_label: str
    tools: list[dict[str, Any]]  # name, description, input_schema, annotations
    error: str | None  # why the listing failed
    status: Literal["in_progress", "completed", "failed"]  # this server's addition


class OutputMcpCall(Reply):
    type: Literal["mcp_call"]
    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None
    # OpenAI's: {type: mcp_tool_execution_error, content} | {type: mcp_protocol_error | http_error,
    # code, message}
    error: dict[str, Any] | None
    approval_request_id: str | None
    status: Literal["in_progress", "completed", "failed"]


class OutputMcpApprovalRequest(Reply):
    type: Literal["mcp_approval_request"]
    id: str  # "mcpr_...": what an mcp_approval_response answers
    server_label: str
    name: str
    arguments: str


class OutputReasoning(Reply):
    type: Literal["reasoning"]
    id: str  # "rs_..."
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]
    content: list[dict[str, Any]]


class ResponseUsage(Reply):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class Response(Reply):
    id: str  # "resp_..."
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputMessage | OutputFunctionCall | OutputFileSearchCall
                 | OutputCodeInterpreterCall | OutputMcpListTools | OutputMcpCall
                 | OutputMcpApprovalRequest | OutputReasoning]
    usage: ResponseUsage | None
    incomplete_details: dict[str, str] | None
    error: dict[str, str] | None  # {"code", "message"} of a failed run
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    max_tool_calls: int | None
    background: bool
    text: dict[str, Any]
    store: bool
    previous_response_id: str | None
    conversation: dict[str, str] | None  # {"id": "conv_..."}
    metadata: dict[str, Any]


class Conversation(Reply):
    id: str  # "conv_..."
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]


class ConversationItem(Reply):
    """An item of a conversation: an input item, or an output item of a response."""

    model_config = ConfigDict(extra="allow")
    type: str
    id: str


class ConversationDeleted(Reply):
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]


class Deleted(Reply):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ItemList(Reply):
    """The input items of a stored response, a page of them (`after`, `limit`, `order`)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseEvent(Reply):
    """One event of a streamed response (the SSE `event:` line repeats `type`): response.created,
    response.in_progress, response.output_item.added / .done, response.content_part.added / .done,
    response.output_text.delta / .annotation.added / .done,
    response.function_call_arguments.delta / .done,
    response.file_search_call.in_progress / .searching / .completed,
    response.code_interpreter_call.in_progress / .interpreting / .completed,
    response.mcp_list_tools.in_progress / .completed / .failed,
    response.mcp_call.in_progress / .completed / .failed, then
    response.completed, response.incomplete or response.failed; every event has its
    `sequence_number`."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
