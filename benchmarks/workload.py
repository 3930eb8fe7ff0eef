"""The benchmarks' fixed workloads: prompts cut from Python's own documentation
(`pydoc_data.topics`, text none of us wrote) and output lengths, both drawn from one seed."""

from __future__ import annotations

import random


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
