"""The ragged batch contract between the scheduler (host, numpy) and the runner (device).

No JAX here: the scheduler builds a `BatchPlan` of numpy arrays and the runner moves it to the device
as one pytree. Shapes are padded to buckets so the number of compiled programs is small and fixed.

Conventions (see DESIGN.md, "Contracts"):
- Page 0 of the pool is the null page: the allocator never hands it out. Padding tokens write their
  K/V to slot 0 (page 0), padding sequences have kv_len 0 and page_indices 0, so padded rows never
  touch a live page.
- `slot_mapping` and `page_indices` index one layer's pool; the model adds `layer * num_pages`
  (pages) or `layer * num_pages * page_size` (slots) because all layers share one cache array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from jaxserve.config import SchedulerConfig
from jaxserve.shapes import cdiv

NULL_PAGE = 0
# Speculation's drafts may fill a step up to this many tokens (or its own bucket's padding, if
# larger): the smallest step before smaller buckets existed, where n-gram speculation was
# measured to pay (benchmarks/RESULTS.md), so drafts keep their room while plain small steps
# take the small buckets.
DRAFT_ROOM_TOKENS = 16


class BatchPlan(NamedTuple):
    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]: page * page_size + offset of each new token's K/V
    cu_q_lens: np.ndarray  # i32[S+1]: query start of each sequence in the flat batch
    kv_lens: np.ndarray  # i32[S]: tokens in the cache for the sequence after this step
    page_indices: np.ndarray  # i32[S, pages_per_seq]
    num_seqs: np.ndarray  # i32[1]
    # i32[R] (R = logits_bucket): the flat rows whose logits are computed, sequence by sequence:
    # each sequence's last token, or, for a decode verifying d draft tokens, its last 1 + d tokens.
    logits_indices: np.ndarray


class SeqChunk(NamedTuple):
    """One sequence's share of a step: `token_ids` are appended at positions start_pos...

    `page_table` lists the sequence's pages in order and must already cover start_pos + len(token_ids).
    The last `num_draft_tokens` of token_ids are speculative (proposed, not yet generated): the
    step computes logits for them and for the token before them, so the sampler can verify them.
    """

    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    num_draft_tokens: int = 0


def pages_for(num_tokens: int, page_size: int) -> int:
    return cdiv(num_tokens, page_size)


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def token_buckets(max_num_batched_tokens: int, min_bucket: int) -> list[int]:
    """Powers of two from min_bucket (or less, if the budget is smaller) to cover the budget."""
    top = next_power_of_two(max_num_batched_tokens)
    b = min(min_bucket, top)
    out = []
    while b <= top:
        out.append(b)
        b *= 2
    return out


def seq_bucket(num_tokens_padded: int, max_num_seqs: int) -> int:
    """Sequences padded per token bucket: a step never holds more sequences than tokens, so tying
    the two keeps one compiled program per token bucket."""
    return min(num_tokens_padded, next_power_of_two(max_num_seqs))


def logits_bucket(num_tokens_padded: int, max_num_seqs: int,
                  num_speculative_tokens: int = 0) -> int:
    """Logits rows a step of this token bucket computes: one per sequence (the seq_bucket), and
    with speculation at least room for one decode verifying num_speculative_tokens drafts (so a
    max_num_seqs=1 engine can speculate). Never more than the step's tokens."""
    return min(num_tokens_padded, max(next_power_of_two(max_num_seqs),
                                      next_power_of_two(1 + num_speculative_tokens)))


def pick_token_bucket(num_tokens: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= num_tokens:
            return b
    raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class StepShapes:
    """The shapes derived from the configs and the pool size, in one place: the scheduler pads
    plans to them and the runner compiles one program per bucket of them, so the two can never
    disagree on a shape."""

    token_buckets: tuple[int, ...]
    max_num_seqs: int
    page_size: int
    pages_per_seq: int  # page-table width: enough pages for max_model_len tokens
    num_pages: int  # KV pool size per device, the null page included
    history_width: int  # penalty history (prompt + output) of one row: the padded max_model_len
    num_speculative_tokens: int = 0  # drafts one decode may verify: sizes the logits rows

    @classmethod
    def of(cls, scheduler: SchedulerConfig, page_size: int, num_pages: int,
           num_speculative_tokens: int = 0) -> "StepShapes":
        # Deterministic: one bucket, so no step's numbers depend on how full it is.
        smallest = (next_power_of_two(scheduler.max_num_batched_tokens)
                    if scheduler.deterministic else scheduler.min_token_bucket)
        return cls(tuple(token_buckets(scheduler.max_num_batched_tokens, smallest)),
                   scheduler.max_num_seqs,
                   page_size, pages_for(scheduler.max_model_len, page_size), num_pages,
                   next_power_of_two(scheduler.max_model_len), num_speculative_tokens)

    def token_bucket(self, num_tokens: int) -> int:
        return pick_token_bucket(num_tokens, self.token_buckets)

    def draft_bucket(self, num_tokens: int) -> int:
        """The token bucket a step of num_tokens may grow to with draft tokens: its own, or the
        one of DRAFT_ROOM_TOKENS (within the largest bucket) if that is larger."""
        room = min(DRAFT_ROOM_TOKENS, self.token_buckets[-1])
        return self.token_bucket(max(num_tokens, room))

    def seq_bucket(self, num_tokens_padded: int) -> int:
        return seq_bucket(num_tokens_padded, self.max_num_seqs)

    def logits_bucket(self, num_tokens_padded: int) -> int:
        return logits_bucket(num_tokens_padded, self.max_num_seqs, self.num_speculative_tokens)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Logits (sampling) rows per step, one count per token bucket (several token buckets may
        share one)."""
        return tuple(sorted({self.logits_bucket(t) for t in self.token_buckets}))


def make_plan(chunks: Sequence[SeqChunk], *, num_tokens_padded: int, num_seqs_padded: int,
              pages_per_seq: int, page_size: int, num_rows_padded: int | None = None) -> BatchPlan:
    """Pack sequence chunks (decodes first, by convention) into padded arrays. num_rows_padded:
    the logits rows (default num_seqs_padded)."""
    if len(chunks) > num_seqs_padded:
        raise ValueError(f"{len(chunks)} sequences exceed the padded count {num_seqs_padded}")
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens_padded:
        raise ValueError(f"{total} tokens exceed the padded count {num_tokens_padded}")
    R = num_seqs_padded if num_rows_padded is None else num_rows_padded
    num_rows = sum(1 + c.num_draft_tokens for c in chunks)
    if num_rows > R:
        raise ValueError(f"{num_rows} logits rows exceed the padded count {R}")
    T, S = num_tokens_padded, num_seqs_padded
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, NULL_PAGE * page_size, np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    kv_lens = np.zeros(S, np.int32)
    page_indices = np.full((S, pages_per_seq), NULL_PAGE, np.int32)
    logits_indices = np.zeros(R, np.int32)
    row = logits_row = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start_pos + n
        if n <= c.num_draft_tokens:
            raise ValueError("a scheduled sequence must have at least one token besides drafts")
        if end > len(c.page_table) * page_size:
            raise ValueError(f"page table of {len(c.page_table)} pages cannot hold {end} tokens")
        if len(c.page_table) > pages_per_seq:
            raise ValueError(f"{len(c.page_table)} pages exceed pages_per_seq={pages_per_seq}")
        pos = np.arange(c.start_pos, end, dtype=np.int32)
        table = np.asarray(c.page_table, np.int32)
        token_ids[row:row + n] = c.token_ids
        positions[row:row + n] = pos
        slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        page_indices[s, :len(table)] = table
        kv_lens[s] = end
        row += n
        cu_q_lens[s + 1] = row
        rows = 1 + c.num_draft_tokens
        logits_indices[logits_row:logits_row + rows] = np.arange(row - rows, row)
        logits_row += rows
    cu_q_lens[len(chunks) + 1:] = row
    return BatchPlan(token_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_indices,
                     np.array([len(chunks)], np.int32), logits_indices)
