"""A remote MCP server for the MCP tool tests, built with the official SDK (`MCPServer`, the SDK's
FastMCP) and served over streamable HTTP: `python -m tests.mcp_server PORT CALL_LOG`. Each call
appends one JSON line to CALL_LOG (tool, arguments, the caller's step id from `_meta`, its
X-Token and Authorization headers), so a test can count what ran."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from pydantic import Field

app = MCPServer("jaxserve-test")


def _log(ctx: Context, name: str, arguments: dict) -> None:
    meta = ctx.request_context.meta or {}
    step_id = meta.get("jaxserve/step_id") if isinstance(meta, dict) else getattr(
        meta, "jaxserve/step_id", None)
    with open(sys.argv[2], "a") as f:
        f.write(json.dumps({"tool": name, "arguments": arguments, "step_id": step_id,
                            "token": (ctx.headers or {}).get("x-token"),
                            "authorization": (ctx.headers or {}).get("authorization")}) + "\n")


@app.tool()
def shout(text: Annotated[str, Field(max_length=8)], ctx: Context) -> str:
    """Say a short text louder."""
    _log(ctx, "shout", {"text": text})
    return text.upper() + "!"


@app.tool()
async def slow_add(a: int, b: int, ctx: Context) -> str:
    """Add two integers, slowly."""
    _log(ctx, "slow_add", {"a": a, "b": b})
    await asyncio.sleep(0.5)
    return str(a + b)


@app.tool()
def broken(word: Annotated[str, Field(max_length=8)], ctx: Context) -> str:
    """Always fails."""
    _log(ctx, "broken", {"word": word})
    raise ValueError(f"broken cannot take {word!r}")


@app.tool()
def huge(ctx: Context) -> str:
    """A very long answer."""
    _log(ctx, "huge", {})
    return "x" * 100_000


if __name__ == "__main__":
    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
