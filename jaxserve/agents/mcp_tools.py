"""The `mcp` server tool: remote MCP servers' tools, called through the official `mcp` SDK's
streamable HTTP client, as OpenAI's Responses API defines the tool (`server_label`, `server_url`,
`allowed_tools`, `require_approval`, `headers`). Host side: no JAX.

A run first lists each server's tools (an `mcp_list_tools` output item; a listing already in the
conversation, from the previous_response_id chain, is used again, as OpenAI does), then offers
each listed tool the request allows to the model as a function of its own name. A call the model
makes is an `mcp_call` item (its `output`, or its `error`, which the model reads); one that
`require_approval` covers (OpenAI's default: every tool) is not made but ends the run with an
`mcp_approval_request` item, and a following request (previous_response_id) carrying an
`mcp_approval_response` that approves it makes the call.

Bounds: only servers on the operator's hosts (--mcp-allowed-hosts; none by default, and then the
tool is not offered); the SDK follows no redirect off the server's origin; a connection, listing
or call past `timeout_s` fails; a server's answers are read up to `max_response_bytes` in all; a
listing keeps `max_tools` tools, each schema up to `max_schema_bytes`; the text the model reads
of a call is cut at `max_output_chars`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator
from urllib.parse import urlsplit

import httpx2

from jaxserve.agents.tools import APPROVAL_ITEM, ToolContext, ToolError
from jaxserve.errors import FailedDependency, InvalidRequest

if TYPE_CHECKING:  # the SDK is imported on first use: it loads OpenTelemetry, which a server
    from mcp import Client  # without --otlp-traces-endpoint must not (tests/test_tracing.py)

log = logging.getLogger(__name__)

LIST_ITEM = "mcp_list_tools"
CALL_ITEM = "mcp_call"
APPROVAL_REQUEST = APPROVAL_ITEM
APPROVAL_RESPONSE = "mcp_approval_response"
MAX_PAGES = 8  # of one listing (a server that pages forever)
MAX_SCHEMA_BYTES = 16 << 10  # of a tool's input schema, as JSON (a listing sent as input too)


@dataclass(frozen=True)
class McpLimits:
    allowed_hosts: tuple[str, ...] = ()  # HOST or HOST:PORT, lower case; empty: no server
    timeout_s: float = 30.0  # connecting and one listing or call, each
    max_response_bytes: int = 4 << 20  # all a server sends for one listing or call
    max_tools: int = 64  # tools kept of one listing (the first, in the server's order)
    max_schema_bytes: int = MAX_SCHEMA_BYTES  # a tool whose input schema is larger is left out
    max_output_chars: int = 32 << 10  # of a call's output, what the model reads and the item holds


def check_url(url: str, limits: McpLimits, param: str) -> None:
    """InvalidRequest naming `param` unless `url` is http(s), has no user info and is on one of
    the allowed hosts (a HOST entry: any port; HOST:PORT: that port)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"'{param}' is not a URL", param=param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"'{param}' must be an http or https URL", param=param)
    if parts.username is not None or parts.password is not None:
        raise InvalidRequest(f"'{param}' may not carry credentials: send them in 'headers'",
                             param=param)
    host = parts.hostname.lower()
    port = port or (443 if parts.scheme == "https" else 80)
    if host not in limits.allowed_hosts and f"{host}:{port}" not in limits.allowed_hosts:
        raise InvalidRequest(f"the MCP server host {host!r} is not allowed on this server "
                             f"(--mcp-allowed-hosts)", param=param)


class _Bounded(httpx2.AsyncBaseTransport):
    """The HTTP transport of one session, failing once the server has sent `limit` bytes (a
    hostile server's endless answer)."""

    def __init__(self, limit: int):
        self.inner = httpx2.AsyncHTTPTransport()
        self.left = limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        response.stream = _Counted(response.stream, self)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Counted(httpx2.AsyncByteStream):
    def __init__(self, stream, owner: _Bounded):
        self.stream, self.owner = stream, owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.owner.left -= len(chunk)
            if self.owner.left < 0:
                raise httpx2.StreamError("the MCP server sent more than this server reads")
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


def _client(config: dict, limits: McpLimits) -> Client:
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = dict(config.get("headers") or {})
    if config.get("authorization"):
        headers["Authorization"] = f"Bearer {config['authorization']}"
    http = httpx2.AsyncClient(headers=headers,
                              timeout=httpx2.Timeout(limits.timeout_s),
                              transport=_Bounded(limits.max_response_bytes))
    return Client(streamable_http_client(config["server_url"], http_client=http),
                  read_timeout_seconds=limits.timeout_s, cache=None)


async def _session(config: dict, limits: McpLimits, what: str, work):
    """`work(client)` in a session of its own; an unreachable or failing server, or one past
    a bound, is a ToolError naming the server, its detail the error as OpenAI's mcp_call
    item has it: the server's JSON-RPC error (`mcp_protocol_error`), or an `http_error` (the
    server's HTTP status; 504 for a timeout, 502 for any other failure to get an answer)."""
    from mcp import MCPError

    label = config["server_label"]
    try:
        async with asyncio.timeout(limits.timeout_s):
            async with _client(config, limits) as client:
                return await work(client)
    except ToolError:
        raise
    except Exception as e:  # the SDK's, httpx's and anyio's errors alike: the model reads it
        while isinstance(e, ExceptionGroup) and e.exceptions:  # anyio wraps the transport's
            e = e.exceptions[0]
        log.info("MCP server %s: %s failed: %r", label, what, e)
        message = f"the MCP server {label!r} failed to {what}: {str(e) or type(e).__name__}"
        if isinstance(e, MCPError):
            detail = {"type": "mcp_protocol_error", "code": e.code, "message": e.message}
        elif isinstance(e, httpx2.HTTPStatusError):
            detail = {"type": "http_error", "code": e.response.status_code, "message": message}
        else:
            timeout = isinstance(e, (TimeoutError, httpx2.TimeoutException))
            detail = {"type": "http_error", "code": 504 if timeout else 502, "message": message}
        raise ToolError(message, detail) from None


class McpTools:
    """The registry's `mcp` kind: lists a server's tools and binds each to a McpFunction."""

    kind = "mcp"
    item_type = CALL_ITEM
    listing_type = LIST_ITEM

    def __init__(self, limits: McpLimits):
        self.limits = limits

    def for_tenant(self, tenant: str) -> McpTools:
        return self

    def check(self, config: dict, param: str) -> None:
        """A request's tool entry (at `param`): its server must be allowed; its token goes in
        `authorization` or in `headers`, not both."""
        check_url(config["server_url"], self.limits, f"{param}.server_url")
        if config.get("authorization") and any(
                name.lower() == "authorization" for name in config.get("headers") or ()):
            raise InvalidRequest(f"'{param}.authorization' and an Authorization header in "
                                 f"'{param}.headers' cannot both be given",
                                 param=f"{param}.authorization")

    @staticmethod
    def failure(config: dict, listing: dict) -> FailedDependency:
        """The request's error for a listing that failed (OpenAI's 424)."""
        return FailedDependency(f"Error retrieving tool list from MCP server: "
                                f"'{config['server_label']}'. {listing['error']}", param="tools")

    @staticmethod
    def listing(item_id: str, config: dict, status: str) -> dict:
        return {"type": LIST_ITEM, "id": item_id, "server_label": config["server_label"],
                "status": status, "tools": [], "error": None}

    async def list(self, context: ToolContext, config: dict, item_id: str) -> dict:
        """The `mcp_list_tools` item of the server's tools this request allows (a failed
        listing: its `error`, no tools)."""
        async def work(client: Client) -> list[dict]:
            tools, cursor = [], None
            for _ in range(MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools += [t.model_dump(mode="json", by_alias=True, exclude_none=True)
                          for t in page.tools]
                cursor = page.next_cursor
                if cursor is None or len(tools) >= self.limits.max_tools:
                    break
            return tools

        item = self.listing(item_id, config, "in_progress")
        try:
            tools = await _session(config, self.limits, "list its tools", work)
        except ToolError as e:
            return {**item, "status": "failed", "error": str(e)}
        kept = []
        for tool in tools:
            schema = tool.get("inputSchema") or {"type": "object"}
            if len(json.dumps(schema)) > self.limits.max_schema_bytes:
                continue
            if not _allowed(config.get("allowed_tools"), tool):
                continue
            kept.append({"name": str(tool["name"])[:128],
                         "description": str(tool.get("description") or "")[:1024],
                         "input_schema": schema, "annotations": tool.get("annotations")})
            if len(kept) == self.limits.max_tools:
                break
        return {**item, "status": "completed", "tools": kept}

    def functions(self, listing: dict, config: dict) -> list[McpFunction]:
        """The listed tools the request (`config`) allows, as functions for the model."""
        return [McpFunction(self.limits, config, tool) for tool in listing.get("tools") or ()
                if _allowed(config.get("allowed_tools"), tool)]

    @staticmethod
    def approved(conversation: list[dict], config: dict, functions: dict) -> list[dict]:
        return approved_calls(conversation, config["server_label"], functions)

    @staticmethod
    def listing_in(items: list[dict], config: dict) -> dict | None:
        """The conversation's last completed listing of this server (one a client sent back
        as input has no status: it is taken as completed)."""
        for item in reversed(items):
            if item.get("type") == LIST_ITEM and item.get("server_label") == \
                    config["server_label"] and not item.get("error") \
                    and item.get("status", "completed") == "completed":
                return item
        return None


def _allowed(allowed: Any, tool: dict) -> bool:
    """`allowed_tools`: a list of names, or {tool_names, read_only} (read_only: only tools the
    server marks readOnlyHint)."""
    if allowed is None:
        return True
    names = allowed if isinstance(allowed, list) else allowed.get("tool_names")
    if names is not None and tool["name"] not in names:
        return False
    if isinstance(allowed, dict) and allowed.get("read_only"):
        return bool((tool.get("annotations") or {}).get("readOnlyHint"))
    return True


def needs_approval(require: Any, name: str) -> bool:
    """`require_approval`: "always" (OpenAI's default), "never", or {always: {tool_names},
    never: {tool_names}} (a tool named in neither needs approval)."""
    if require is None or require == "always":
        return True
    if require == "never":
        return False
    if name in ((require.get("never") or {}).get("tool_names") or ()):
        return False
    return True


class McpFunction:
    """One remote tool offered to the model (agents.tools.ServerTool): its function name is the
    tool's."""

    kind = "mcp"
    item_type = CALL_ITEM

    def __init__(self, limits: McpLimits, config: dict, tool: dict):
        self.limits = limits
        self.config = config
        self.name = tool["name"]
        self.description = tool.get("description") or f"{self.name} ({config['server_label']})"
        if config.get("server_description"):
            self.description += (f"\n(A tool of the MCP server {config['server_label']!r}: "
                                 f"{config['server_description']})")
        self.parameters = tool["input_schema"]
        self.needs_approval = needs_approval(config.get("require_approval"), self.name)

    async def execute(self, context: ToolContext, arguments: dict, config: dict) -> str:
        """The call's output text; the server's error result, or a failure, is a ToolError.
        The step id goes along in the request's _meta (an idempotency key a server may use:
        a call re-issued after a restart carries the same)."""
        async def work(client: Client):
            return await client.call_tool(self.name, arguments,
                                          meta={"jaxserve/step_id": context.step_id})

        result = await _session(self.config, self.limits, f"run {self.name!r}", work)
        text = _text(result, self.limits.max_output_chars)
        if result.is_error:
            raise ToolError(text or "the tool failed", {
                "type": "mcp_tool_execution_error", "content": [{"type": "text", "text": text}]})
        return text

    def item(self, item_id: str, arguments: dict, status: str, result: Any,
             error: str | None = None, approval_request_id: str | None = None) -> dict:
        return {"type": CALL_ITEM, "id": item_id, "server_label": self.config["server_label"],
                "name": self.name, "arguments": json.dumps(arguments), "status": status,
                "output": result, "error": error, "approval_request_id": approval_request_id}

    def approval_request(self, item_id: str, arguments: dict) -> dict:
        return {"type": APPROVAL_REQUEST, "id": item_id,
                "server_label": self.config["server_label"], "name": self.name,
                "arguments": json.dumps(arguments)}

    def call_name(self, item: dict) -> str:
        return item["name"]

    def arguments(self, item: dict) -> dict:
        return _json_object(item.get("arguments"))

    def model_text(self, item: dict) -> str:
        return call_text(item)


def call_text(item: dict) -> str:
    """What the model reads of an `mcp_call` item: its output, or its error."""
    if item.get("status") == "completed":
        return item.get("output") or ""
    error = item.get("error")
    if isinstance(error, dict):
        error = error.get("message") or "".join(
            c.get("text") or "" for c in error.get("content") or ())
    return f"error: {error or 'the call failed'}"


def _json_object(text: Any) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(result, limit: int) -> str:
    """A CallToolResult as text: its text blocks; other blocks named; its structured content
    when it has no text; cut at `limit` characters (saying so)."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} not shown]")
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    if len(text) > limit:
        text = text[:limit] + f"\n[cut: {len(text)} characters, {limit} kept]"
    return text


def approved_calls(conversation: list[dict], label: str,
                   functions: dict[str, tuple[Any, dict]]) -> list[dict]:
    """The calls this server's approved requests ask for: for each `mcp_approval_response`
    approving an `mcp_approval_request` of server `label` that no `mcp_call` answers yet, the
    call, in progress (or failed when the request no longer offers the tool)."""
    requests = {i["id"]: i for i in conversation if i.get("type") == APPROVAL_REQUEST
                and i.get("server_label") == label}
    made = {i.get("approval_request_id") for i in conversation if i.get("type") == CALL_ITEM}
    calls = []
    for item in conversation:
        if item.get("type") != APPROVAL_RESPONSE or not item.get("approve"):
            continue
        request = requests.get(item["approval_request_id"])
        if request is None or request["id"] in made:
            continue
        made.add(request["id"])
        function = (functions.get(request["name"]) or (None,))[0]
        item_id = "mcp_" + request["id"].split("_", 1)[-1]  # the same after a restart
        arguments = _json_object(request["arguments"])
        if isinstance(function, McpFunction) and function.config["server_label"] == label:
            calls.append(function.item(item_id, arguments, "in_progress", None,
                                       approval_request_id=request["id"]))
        else:
            calls.append({"type": CALL_ITEM, "id": item_id, "server_label": label,
                          "name": request["name"], "arguments": request["arguments"],
                          "status": "failed", "output": None, "approval_request_id":
                          request["id"], "error": {"type": "mcp_protocol_error", "code": -32602,
                                                   "message": "the tool is no longer offered"}})
    return calls
