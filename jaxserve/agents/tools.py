"""Server-side tools: the registry of tool kinds a run executes itself (as opposed to `function`
tools, which the client executes). Host side: no JAX.

A tool kind (`ServerTool`) says how the model calls it (a function name, description and JSON
schema: the chat path generates the call's arguments under that schema, so a malformed call
cannot happen), runs it (`execute(context, arguments, config)`, async; `config` is the tool's
entry of the request's `tools`), and how its call and result look as a Responses output item
(`item`). An executor raises ToolError for a failure the model should see (its message becomes
the tool's output, so the model can correct itself); the run bounds its time
(`ToolContext.deadline_at`). `context.step_id` is the step's id in the run's step log: a call
re-issued after a crash carries the same id, for a tool with side effects to use as its
idempotency key.

A kind whose functions are not known in advance (remote MCP servers: agents/mcp_tools.py) has a
`listing_type` and lists them in a run (`list`, `listing`, `listing_in`, `functions`: each a
ServerTool of its own, named by its function); a function may need the user's approval first
(`needs_approval`, `approval_request`, and the kind's `approved` for the calls a later request's
input approves).

The run's step log (agents/run.py) knows nothing of any one tool: code execution, MCP and other
kinds plug in by registering here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# The output item of a call that waits for the user's approval (OpenAI's, of remote MCP tools).
APPROVAL_ITEM = "mcp_approval_request"


class ToolError(Exception):
    """A tool call failed; its message is what the model reads as the tool's output. `detail`:
    the failed item's `error`, where the tool's item has one (else the message)."""

    def __init__(self, message: str, detail: Any = None):
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class ToolContext:
    tenant: str
    response_id: str
    step_id: str
    deadline_at: float | None  # unix time; None: the run has none


class ServerTool(Protocol):
    kind: str  # the `type` of the request's tool entry, e.g. "file_search"; the function name
    item_type: str  # the `type` of its output item, e.g. "file_search_call"
    description: str
    parameters: dict  # the JSON schema of the call's arguments

    def for_tenant(self, tenant: str) -> ServerTool:
        """This tool as `tenant` is offered it (its own limits and schema; else itself)."""

    async def execute(self, context: ToolContext, arguments: dict, config: dict) -> Any:
        """The result (JSON), or ToolError."""

    def item(self, item_id: str, arguments: dict, status: str, result: Any) -> dict:
        """The output item of a call (`result` None while it runs, or when it failed)."""

    def arguments(self, item: dict) -> dict:
        """The call's arguments, read back from its item (a stored conversation's)."""

    def model_text(self, item: dict) -> str:
        """What the model reads as the output of a completed call, from its item."""


class ToolRegistry:
    def __init__(self, tools: tuple[ServerTool, ...] = ()):
        self._tools: dict[str, ServerTool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: ServerTool) -> None:
        if tool.kind in self._tools:
            raise ValueError(f"the tool kind {tool.kind!r} is registered already")
        self._tools[tool.kind] = tool

    def get(self, kind: str) -> ServerTool | None:
        return self._tools.get(kind)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(self._tools))
