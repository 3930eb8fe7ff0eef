"""A version's generation defaults (`[version.NAME.generation]` of a deployment file) applied to a
request body: each fills only what the client left out, so a client's own value always wins.

`system_prompt` opens a chat that brings no system (or developer) message of its own; the rest are
the OpenAI body fields of the same name (`max_tokens` also stands for chat's
`max_completion_tokens`). The result is parsed again, through the same checks as any body.
"""

from __future__ import annotations

from typing import Any


def with_defaults(body: dict, kind: str, defaults: dict[str, Any]) -> dict:
    """A copy of the (already validated) body with the defaults it lacks."""
    body = dict(body)
    for field, value in defaults.items():
        if field == "system_prompt":
            messages = body.get("messages")
            if kind == "chat" and not any(m.get("role") in ("system", "developer")
                                          for m in messages):
                body["messages"] = [{"role": "system", "content": value}, *messages]
        elif field == "max_tokens" and body.get("max_completion_tokens") is not None:
            continue
        elif body.get(field) is None:
            body[field] = list(value) if isinstance(value, tuple) else value
    return body
