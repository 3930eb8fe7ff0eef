"""Where a prompt-cache breakpoint falls in the rendered prompt (Anthropic's cache_control).

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
