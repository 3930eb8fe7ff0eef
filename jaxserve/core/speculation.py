"""n-gram ("prompt lookup") speculation: draft tokens copied from the sequence's own history.

Host side only (numpy, no JAX). A sequence that ends with an n-gram it already contains (in its
prompt or in its output) is likely to go on as it did after that earlier occurrence: summaries,
edits and answers about a given text copy long runs of it. The proposer looks for the longest
suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that occurred before, takes the
most recent such occurrence, and proposes up to k tokens that followed it. The model then checks
all of them in one step (see `jaxserve.core.engine`): a decode row becomes a 1 + k token query whose
every row is sampled, and the tokens the model itself draws decide how many drafts stand.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxserve.config import SpeculativeConfig


def propose_ngram(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of token_ids (min_n <= n <= max_n); empty when no such n-gram occurred before."""
    L = len(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # Windows starting at 0..L-n-1: each occurrence is followed by at least one token.
        windows = sliding_window_view(token_ids[:L - 1], n)
        hits = np.flatnonzero((windows == token_ids[L - n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return token_ids[start:start + k]
    return token_ids[:0]


class NgramProposer:
    """Drafts for the engine's sequences under one SpeculativeConfig."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most min(k, num_speculative_tokens) draft tokens to follow token_ids."""
        k = min(k, self.config.num_speculative_tokens)
        if k <= 0:
            return []
        c = self.config
        return propose_ngram(np.asarray(token_ids, np.int64), k, c.prompt_lookup_min,
                             c.prompt_lookup_max).tolist()
