"""Where a prompt-cache breakpoint falls in the rendered prompt (Anthropic's cache_control,
OpenAI's prompt_cache_breakpoint: `chat_breakpoints`).

A breakpoint is given as the chat messages up to and including the block that carries it (the
block's message cut after that block) and its TTL. Its token position comes from rendering those
messages with the request's chat template, tools and template kwargs, without the generation
prompt. A template may render a prefix differently when more messages follow (an end-of-turn
marker, a "last message" branch), so the position is the length of the common prefix of that
rendering and the whole prompt: only tokens that really are the prompt's are pinned, and the
cache pins the whole pages within them (jaxserve.core.cache). A prefix the template refuses to
render alone pins nothing (the request is served as usual).

No I/O and no JAX.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.errors import InvalidRequest

# A breakpoint: the chat messages it ends, and the pin's TTL in seconds.
Breakpoint = tuple[list[dict], float]
MAX_BREAKPOINTS = 4  # Anthropic's and OpenAI's limit per request (each renders the prompt again)
# The TTLs a request may ask for: Anthropic's "5m" (the default) and "1h", OpenAI's "30m".
TTL_SECONDS = {"5m": 300.0, "30m": 1800.0, "1h": 3600.0}
DEFAULT_TTL = "5m"


def chat_breakpoints(messages, flat: list[dict], default_ttl: str | None) -> list[Breakpoint]:
    """OpenAI's `prompt_cache_breakpoint`s of validated chat messages (`flat`: the same messages
    as the template takes them): each text part that carries one ends its breakpoint, the
    message cut after that part."""
    out = []
    for i, message in enumerate(messages):
        parts = message.content if isinstance(message.content, list) else ()
        for j, part in enumerate(parts):
            mark = part.prompt_cache_breakpoint
            if mark is None:
                continue
            # A cut message keeps only its text (tool calls render after the whole content).
            cut = flat[i] if j == len(parts) - 1 else {
                "role": message.role, "content": "".join(p.text for p in parts[:j + 1])}
            out.append((flat[:i] + [cut], TTL_SECONDS[mark.ttl or default_ttl or DEFAULT_TTL]))
    if len(out) > MAX_BREAKPOINTS:
        raise InvalidRequest(f"at most {MAX_BREAKPOINTS} text parts may carry a "
                             f"prompt_cache_breakpoint, got {len(out)}",
                             param="prompt_cache_breakpoint")
    return out


def pin_positions(tokenizer, prompt_ids: Sequence[int], breakpoints: Sequence[Breakpoint],
                  tools, template_kwargs) -> tuple[tuple[int, float], ...]:
    """(prompt tokens, seconds) of each breakpoint that covers at least one token, in order."""
    out = []
    for messages, ttl_s in breakpoints:
        try:
            prefix = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                   tools=tools, template_kwargs=template_kwargs)
        except InvalidRequest:
            continue
        n = 0
        for a, b in zip(prefix, prompt_ids):
            if a != b:
                break
            n += 1
        if n:
            out.append((n, ttl_s))
    return tuple(out)
