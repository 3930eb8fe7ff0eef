"""The benchmarks' fixed workloads, drawn from one seed, from text none of us wrote:
- `pydoc_workload`: prompts cut from Python's own documentation (`pydoc_data.topics`) and
  output lengths;
- `grounded_workload`: input-grounded chat requests (summarise, copy-edit or rewrite a given
  passage of that documentation; document, rename or explain a given function of Python's
  standard library), the kind of request whose answer copies its input, where speculative
  decoding with n-gram drafts pays."""

from __future__ import annotations

import importlib
import inspect
import random

TEXT_TASKS = (
    "Summarize the following text in a few sentences.",
    "Fix any spelling or grammar mistakes in the following text and write out the corrected "
    "text in full.",
    "Rewrite the following text in plain English, keeping every detail.",
)
CODE_TASKS = (
    "Add a docstring to the following Python function. Output the whole function.",
    "Rewrite the following Python function with clearer variable names. Output only the code.",
    "Explain what the following Python function does, quoting the relevant lines.",
)
# Short standard-library functions written in Python (inspect.getsource works on them).
FUNCTIONS = ("textwrap.indent", "shlex.quote", "fnmatch.filter", "string.capwords",
             "colorsys.rgb_to_hsv", "statistics.median", "statistics.mode", "base64.b64encode",
             "html.escape", "glob.escape", "functools.total_ordering", "textwrap.shorten",
             "mimetypes.guess_type", "colorsys.rgb_to_hls", "calendar.monthrange")


def pydoc_workload(tokenizer, num_requests: int, *, seed: int, prompt_tokens: tuple[int, int],
                   output_tokens: tuple[int, int]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, lengths uniform in the inclusive ranges."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    corpus = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)),
                              add_special_tokens=False)
    work = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_tokens)
        start = rng.randrange(len(corpus) - n)
        work.append((corpus[start:start + n], rng.randint(*output_tokens)))
    return work


def _passages(max_chars: int) -> list[str]:
    """Leading paragraphs of each pydoc topic, up to max_chars (at least one paragraph)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = ""
        for para in topics[key].split("\n\n"):
            if text and len(text) + len(para) > max_chars:
                break
            text = f"{text}\n\n{para}" if text else para
        if 300 <= len(text) <= max_chars:
            out.append(text.strip())
    return out


def _functions() -> list[str]:
    sources = []
    for name in FUNCTIONS:
        module, attr = name.rsplit(".", 1)
        sources.append(inspect.getsource(getattr(importlib.import_module(module), attr)))
    return sources


def grounded_workload(tokenizer, num_requests: int, *, seed: int, max_chars: int = 1500,
                      max_tokens: int = 128) -> list[tuple[list[int], int]]:
    """(chat prompt token ids, max_tokens) per request: half text tasks over a documentation
    passage, half code tasks over a standard-library function, each task and source drawn
    with the seed."""
    rng = random.Random(seed)
    passages, functions = _passages(max_chars), _functions()
    work = []
    for i in range(num_requests):
        if i % 2 == 0:
            content = f"{rng.choice(TEXT_TASKS)}\n\n{rng.choice(passages)}"
        else:
            content = f"{rng.choice(CODE_TASKS)}\n\n```python\n{rng.choice(functions)}```"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True)
        work.append((list(ids), max_tokens))
    return work


def multi_turn_workload(num_conversations: int, turns: int, *, seed: int,
                        user_chars: tuple[int, int] = (150, 400),
                        assistant_chars: tuple[int, int] = (300, 700)) -> list[list[dict]]:
    """Multi-turn chats, replayed: the chat messages each request sends, in the order they
    are sent. Conversation c's turn t is its t earlier turns (their user messages and recorded
    assistant replies, documentation passages as in `pydoc_workload`) and a new user message;
    the conversations take turns round-robin, so every turn's history was sent one round
    before and was pushed out of a pool smaller than the working set (all conversations'
    final histories) by the others meanwhile."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    corpus = "\n\n".join(topics[k] for k in sorted(topics))

    def text(chars: tuple[int, int]) -> str:
        n = rng.randint(*chars)
        start = rng.randrange(len(corpus) - n)
        return corpus[start:start + n]

    chats = [[{"role": "system", "content": "You answer questions about Python."}]
             for _ in range(num_conversations)]
    order = []
    for _ in range(turns):
        for chat in chats:
            chat.append({"role": "user", "content": f"{rng.choice(TEXT_TASKS)}\n\n"
                                                    f"{text(user_chars)}"})
            order.append(list(chat))
            chat.append({"role": "assistant", "content": text(assistant_chars)})
    return order
