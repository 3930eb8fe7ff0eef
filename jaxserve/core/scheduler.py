"""Continuous batching with chunked prefill: which tokens of which requests run this step.

Plain Python and numpy (no JAX): `schedule()` returns a padded `BatchPlan` and the rows it holds;
`update_from_output()` takes the sampled token ids back. Each step:
0. requests past their deadline end (FINISHED_DEADLINE), queued or running, and requests never
   started by their queue deadline end (FINISHED_QUEUE_TIMEOUT): their pages go back at once and
   no step is spent on them;
1. running requests with one token left (decodes), most important first;
2. prefill chunks of running requests that are part-way through their prompt (or a recompute);
3. waiting and preempted requests in the fair queue's order (`jaxserve.core.fair_queue`: strict
   priority, then start-time fair queuing by tokens among the tenants of a priority), as far as
   the token budget, the sequence limit and the free pages allow. A chunk is cut to what the
   budget and the pool can take, so a long prompt is spread across steps while the decodes keep
   flowing. With prefix caching, a request whose next uncached page another running request is
   computing right now (n > 1 siblings, the same prompt twice) is passed over until that page is
   cached: it is computed once. A tenant with a KV page budget (`kv_page_fraction`) whose running
   requests hold it is passed over (its requests wait; a running request is never preempted for
   its own tenant's budget, and a tenant holding no page may always start one request, so a
   request larger than the budget still runs). A request that scores its prompt
   (`Request.scores_prompt`) takes no prefix from the cache: every prompt position is computed.
With a host tier (`num_host_pages`, --kv-offloading-size), a waiting request's prefix pages that
the device evicted and the host holds are brought back before it is looked up
(KVCacheManager.restore_prefix); the step's copies to and from the host ride in its output
(`page_copies`) and run before its forward. With a disk tier the next waiting requests' pages
on disk are read ahead while the step runs (`_read_ahead`).
Prompt-cache pins (`Request.cache_pins`, Anthropic's cache_control) are made as soon as their
prefix is computed, and expired pins are released at the start of each step (KVCacheManager.pin);
a waiting request that cannot start while nothing runs releases pins, oldest first, until it can.
When a running request cannot get a page, the least important running request not yet in this
step (largest priority value, then most recently admitted) is preempted (possibly the request
itself) instead of failing; then the step admits nobody (pages are short: admitting would only
churn). A waiting request of strictly higher priority than a running one, finding no sequence slot
or no page, preempts it the same way. A request preempted in a step is not readmitted in it.
With a drafter (speculative decoding), decodes then take draft tokens in what is left of the step:
only the padding of its token bucket, or of the bucket of DRAFT_ROOM_TOKENS (16) for a smaller
step (`StepShapes.draft_bucket`), and of that bucket's logits rows; never pages that would need a
preemption, never past max_tokens or max_model_len. So speculation backs off by itself as the
batch fills (a full batch gets no drafts) and never needs a program warmup did not compile.
`update_from_output` keeps the drafts the sampled tokens confirm.
Async scheduling (LLMEngine): a step may be scheduled before the previous one's tokens are read.
`update_from_output` then takes placeholders, token -(r + 1) for logits row r, which the runner
replaces on the device, and `resolve_placeholders` puts the real tokens in once read. A request
whose placeholder is its last token by length (max_tokens, max_model_len) is not scheduled again:
the engine ends it when the token is read.
The engine decides when a request stops (eos, max_tokens, stop strings) and calls
`finish_request`; the scheduler itself ends requests that can never run (FINISHED_ERROR), outgrow
max_model_len (FINISHED_LENGTH) or run out of time (above): see `take_finished`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from jaxserve.executor.batch_plan import BatchPlan, SeqChunk, StepShapes, make_plan
from jaxserve.executor.page_copies import PageCopies
from jaxserve.core.cache import KVCacheManager
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.errors import ConfigError
from jaxserve.core.fair_queue import FairQueue
from jaxserve.core.kv_disk import DiskTier
from jaxserve.core.kv_offload import HostTier
from jaxserve.core.request import Request, RequestStatus


# Waiting requests whose disk-tier pages are read ahead each step (the next to be admitted).
READ_AHEAD_REQUESTS = 2

# (request, n) -> up to n draft tokens to follow the request's tokens (jaxserve.core.speculation).
Drafter = Callable[[Request, int], Sequence[int]]


class ScheduledSeq(NamedTuple):
    request: Request
    num_tokens: int  # of all_token_ids (drafts not counted)
    samples: bool  # the chunk reaches the end of all_token_ids: its last row is sampled
    draft_token_ids: tuple[int, ...] = ()  # proposed tokens verified after the last one

    @property
    def num_rows(self) -> int:
        """Its logits rows: the last token's, and one per draft."""
        return 1 + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    plan: BatchPlan
    scheduled: list[ScheduledSeq]  # in plan row order: decodes, then prefill chunks
    preempted: list[Request] = field(default_factory=list)
    # Copies between the device pool and the host tier, to run in order before the forward.
    page_copies: tuple[PageCopies, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens + len(s.draft_token_ids) for s in self.scheduled)


@dataclass
class _Step:
    """The step being built."""

    budget: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    short_of_pages: bool = False  # a running request needed a page and preempted for it
    _ids: set[str] = field(default_factory=set)

    def add(self, request: Request, n: int) -> None:
        self.budget -= n
        self._ids.add(request.request_id)
        self.scheduled.append(ScheduledSeq(
            request, n, request.num_computed_tokens + n == request.num_tokens))

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._ids


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int  # preempted requests included
    pages_in_use: int  # held by live requests
    pages_cached_free: int  # held only by the prefix cache, reusable and evictable
    num_usable_pages: int  # the pool less the null page
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int  # total since start
    num_new_by_priority: dict[int, int]  # waiting requests never admitted, per priority
    num_draft_tokens: int = 0  # proposed and verified, total since start
    num_accepted_draft_tokens: int = 0  # of which the model confirmed
    host_tier_queries: int = 0  # prompt tokens of full pages looked up past the device's hits
    host_tier_hits: int = 0  # of which restored from the host tier
    host_tier_pages: int = 0  # pages the host tier holds
    host_tier_slots: int = 0  # pages it can hold (0: no host tier)
    num_pins: int = 0  # prompt-cache pins held now
    pinned_pages: int = 0  # pages they hold (a page two pins share counts twice)
    pins_expired: int = 0  # pins released at their TTL, total since start
    disk_tier_hits: int = 0  # of host_tier_hits, restored from the disk tier
    disk_tier_pages: int = 0  # pages the disk tier holds
    disk_tier_files: int = 0  # pages it can hold (0: no disk tier)
    disk_tier_read_seconds: float = 0.0  # the engine thread's seconds waiting for their reads
    disk_tier_bytes_written: int = 0  # file bytes its worker wrote


def _disk_stats(disk: DiskTier | None) -> dict:
    if disk is None:
        return {}
    return dict(disk_tier_pages=disk.num_pages, disk_tier_files=disk.num_files,
                disk_tier_read_seconds=disk.read_seconds,
                disk_tier_bytes_written=disk.io.stats.bytes_written)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_pages: int, clock: Callable[[], float] = time.monotonic, *,
                 drafter: Drafter | None = None, num_speculative_tokens: int = 0,
                 num_host_pages: int = 0, disk_tier: DiskTier | None = None):
        if (not scheduler_config.enable_chunked_prefill
                and scheduler_config.max_num_batched_tokens < scheduler_config.max_model_len):
            # Without chunking a prompt must fit one step, or it would wait forever.
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({scheduler_config.max_num_batched_tokens}) must be >= max_model_len "
                f"({scheduler_config.max_model_len})")
        self.config = scheduler_config
        self.page_size = cache_config.page_size
        self.cache = KVCacheManager(
            num_pages, cache_config.page_size, cache_config.enable_prefix_caching,
            host_tier=HostTier(num_host_pages, disk_tier) if num_host_pages else None)
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.shapes = StepShapes.of(scheduler_config, cache_config.page_size, num_pages,
                                    self.num_speculative_tokens)
        self.clock = clock  # the deadlines' clock (time.monotonic); tests inject their own
        self.waiting = FairQueue()  # preempted requests included
        self.running: list[Request] = []  # in admission order
        self._requests: dict[str, Request] = {}
        self._admitted_at: dict[str, int] = {}  # request_id -> admission counter, for victims
        self._num_admissions = 0
        # (time, tie-break, request id, queue deadline?) with stale entries skipped when popped
        self._deadlines: list[tuple[float, int, str, bool]] = []
        self._deadline_count = itertools.count()
        self._finished: list[Request] = []  # ended by the scheduler, not yet taken by the engine
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

    # ---- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """Queue requests (e.g. the n sequences of one API request) in one step, all or none;
        each costs the fair queue's O(log T), whatever the queue's length. The engine checked
        them once (LLMEngine.prepare, add_request): unique ids and a non-empty prompt within
        max_model_len are invariants here."""
        ids = {r.request_id for r in requests}
        assert len(ids) == len(requests) and ids.isdisjoint(self._requests), "ids in use"
        assert all(r.prompt_token_ids and r.num_tokens <= self.config.max_model_len
                   for r in requests), "a prompt the engine refuses"
        for request in requests:
            request.status = RequestStatus.WAITING
            self._requests[request.request_id] = request
            self.waiting.push(request)
            for when, queue_only in ((request.deadline, False), (request.queue_deadline, True)):
                if when is not None:
                    heapq.heappush(self._deadlines, (when, next(self._deadline_count),
                                                     request.request_id, queue_only))

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request wherever it is (waiting, running, preempted) and free its pages.
        False if the id is unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.cache.free(request)
        request.status = status
        self.waiting.settle(request)
        self._admitted_at.pop(request_id, None)
        return True

    def shed_order(self, below: int) -> Iterator[Request]:
        """Waiting requests never admitted, of priorities after `below`, in the order to shed
        them (see `FairQueue.shed_order`); end them with `finish_request(.., FINISHED_SHED)`
        after iterating."""
        return self.waiting.shed_order(below)

    def take_finished(self) -> list[Request]:
        """Requests the scheduler ended itself since the last call (FINISHED_ERROR: can never fit
        the page pool; FINISHED_LENGTH: outgrew max_model_len). The engine reports them."""
        out, self._finished = self._finished, []
        return out

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        now = self.clock()
        self._expire(now)
        self.cache.expire_pins(now)
        for r in list(self.running):
            if r.num_tokens > self.config.max_model_len:
                self._end(r, RequestStatus.FINISHED_LENGTH)
        step = _Step(self.config.max_num_batched_tokens)
        self._preempt_for_priority(step)
        by_importance = sorted(self.running, key=self._victim_key)
        for r in by_importance:
            # A request preempted earlier in this loop, to make room for a more important one, is
            # no longer running.
            if r.num_tokens - r.num_computed_tokens == 1 and r.status == RequestStatus.RUNNING \
                    and not self._has_last_token(r):
                if self._make_room(r, 1, step):
                    step.add(r, 1)
        for r in by_importance:
            if r.num_tokens - r.num_computed_tokens > 1 and r.status == RequestStatus.RUNNING:
                n = self._prefill_chunk(r, step.budget)
                if n > 0 and self._make_room(r, n, step):
                    step.add(r, n)
        if not step.short_of_pages:  # else admitting more would only churn
            self._admit_waiting(step)
        self._read_ahead()
        if not step.scheduled:
            return None
        if self.drafter is not None:
            self._add_drafts(step)
        t_pad = self.shapes.token_bucket(self.config.max_num_batched_tokens - step.budget)
        chunks = [SeqChunk(r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n)
                           + list(drafts), r.num_computed_tokens, r.page_table, len(drafts))
                  for r, n, _, drafts in step.scheduled]
        plan = make_plan(chunks, num_tokens_padded=t_pad,
                         num_seqs_padded=self.shapes.seq_bucket(t_pad),
                         pages_per_seq=self.shapes.pages_per_seq, page_size=self.page_size,
                         num_rows_padded=self.shapes.logits_bucket(t_pad))
        return SchedulerOutput(plan, step.scheduled, step.preempted,
                               self.cache.take_page_copies())

    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: np.ndarray) -> list[tuple[Request, list[int]]]:
        """Advance the scheduled requests; return (request, new tokens) for each that sampled.
        `sampled_token_ids` has one token per logits row (see ScheduledSeq.num_rows): a decode's
        drafts stand up to the first one its row's sampled token differs from, and that token
        (or, with every draft confirmed, the last row's) follows them. Rows of requests finished
        since `schedule()` (an abort in between) are skipped."""
        sampled_token_ids = np.asarray(sampled_token_ids)
        new_tokens = []
        row = 0
        for request, n, samples, drafts in out.scheduled:
            rows = sampled_token_ids[row:row + 1 + len(drafts)].tolist()
            row += 1 + len(drafts)
            if request.status != RequestStatus.RUNNING:
                continue
            if not samples:
                request.num_computed_tokens += n
                self.cache.register_full_pages(request)
                self._pin(request)
                continue
            accepted = 0
            while accepted < len(drafts) and rows[accepted] == drafts[accepted]:
                accepted += 1
            if drafts:
                self.num_draft_tokens += len(drafts)
                self.num_accepted_draft_tokens += accepted
                request.num_draft_tokens += len(drafts)
                request.num_accepted_draft_tokens += accepted
            tokens = rows[:accepted + 1]
            # The rejected drafts' K/V stay in the pages past num_computed_tokens, where the
            # next tokens overwrite them; only the confirmed ones count as computed.
            request.num_computed_tokens += n + accepted
            request.output_token_ids.extend(tokens)
            self.cache.register_full_pages(request)  # after the extend: it hashes the tokens
            self._pin(request)
            new_tokens.append((request, tokens))
        return new_tokens

    def resolve_placeholders(self, new_tokens: list[tuple[Request, list[int]]],
                             sampled_token_ids: np.ndarray) -> list[tuple[Request, list[int]]]:
        """Put a step's sampled tokens (one per logits row) in place of the placeholders
        `update_from_output` appended for it; returns the new tokens as it would have."""
        out = []
        for request, placeholders in new_tokens:
            tokens = [int(sampled_token_ids[-t - 1]) for t in placeholders]
            n = len(tokens)
            assert request.output_token_ids[-n:] == placeholders, "placeholders are the last"
            request.output_token_ids[-n:] = tokens
            # Page hashes memoized over a placeholder (KVCacheManager.pages_in_flight hashes up
            # to num_tokens) are stale: hashed again when needed.
            del request.page_hashes[(request.num_tokens - n) // self.page_size:]
            out.append((request, tokens))
        return out

    def stats(self) -> SchedulerStats:
        tier = self.cache.host_tier
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            pages_in_use=self.cache.num_pages_in_use,
            pages_cached_free=self.cache.num_cached_free_pages,
            num_usable_pages=self.cache.num_usable_pages,
            prefix_cache_queries=self.cache.prefix_cache_queries,
            prefix_cache_hits=self.cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_new_by_priority=self.waiting.num_new_by_priority(),
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            host_tier_queries=self.cache.host_tier_queries,
            host_tier_hits=self.cache.host_tier_hits,
            host_tier_pages=tier.num_pages if tier is not None else 0,
            host_tier_slots=tier.num_slots if tier is not None else 0,
            num_pins=self.cache.num_pins, pinned_pages=self.cache.num_pinned_pages,
            pins_expired=self.cache.pins_expired, disk_tier_hits=self.cache.disk_tier_hits,
            **_disk_stats(tier.disk if tier is not None else None))

    # ---- internals ---------------------------------------------------------------------------

    def _pin(self, request: Request) -> None:
        """Pin the request's prefixes (`Request.cache_pins`) whose tokens are computed now. The
        tokens a new pin covers beyond what the request read from the cache were written for it
        (Anthropic's cache_creation_input_tokens; overlapping pins count once)."""
        if not request.cache_pins:
            return
        pending = []
        for num_tokens, ttl_s in request.cache_pins:
            if request.num_computed_tokens < num_tokens:
                pending.append((num_tokens, ttl_s))
                continue
            pinned = self.cache.pin(request, num_tokens, ttl_s, self.clock())
            request.num_cache_creation_tokens = max(
                request.num_cache_creation_tokens, pinned - request.num_cached_prompt_tokens)
        request.cache_pins = tuple(pending)

    def _add_drafts(self, step: _Step) -> None:
        """Give the step's decodes draft tokens in its spare room: the padding of its draft
        bucket and of that bucket's logits rows, within the budget, over pages free without a
        preemption. Drafts are dealt one per decode at a time, most important first, since a
        sequence's first draft is its likeliest to stand."""
        used = self.config.max_num_batched_tokens - step.budget
        bucket = self.shapes.draft_bucket(used)
        spare = min(bucket - used, step.budget,
                    self.shapes.logits_bucket(bucket) - len(step.scheduled))
        if spare <= 0:
            return
        proposals: dict[int, list[int]] = {}
        for i, (r, n, samples, _) in enumerate(step.scheduled):
            if not samples or n != 1:
                continue
            # Never past max_tokens or max_model_len, even if every draft stands.
            cap = min(self.num_speculative_tokens, spare,
                      self.config.max_model_len - r.num_tokens - 1,
                      self.cache.num_allocatable_tokens(r) - 1)
            if r.max_tokens is not None:
                cap = min(cap, r.max_tokens - len(r.output_token_ids) - 1)
            if cap > 0:
                drafts = list(self.drafter(r, cap))[:cap]
                if drafts:
                    proposals[i] = drafts
        counts = dict.fromkeys(proposals, 0)
        while spare > 0 and any(counts[i] < len(d) for i, d in proposals.items()):
            for i, drafts in proposals.items():
                if spare > 0 and counts[i] < len(drafts):
                    counts[i] += 1
                    spare -= 1
        for i, count in counts.items():
            r, n, samples, _ = step.scheduled[i]
            # Earlier decodes' drafts may have taken the free pages this one counted on.
            count = min(count, self.cache.num_allocatable_tokens(r) - n)
            if count > 0 and self.cache.allocate(r, n + count):
                step.scheduled[i] = ScheduledSeq(r, n, samples, tuple(proposals[i][:count]))
                step.budget -= count

    def _has_last_token(self, request: Request) -> bool:
        """Whether the request's last token, still a placeholder, is its last by length
        (max_tokens, max_model_len): the engine ends it when that token is read."""
        out = request.output_token_ids
        return bool(out) and out[-1] < 0 and (request.num_tokens >= self.config.max_model_len or (
            request.max_tokens is not None and len(out) >= request.max_tokens))

    def _victim_key(self, request: Request) -> tuple[int, int]:
        """Sorts running requests most important first; the last one is preempted first."""
        return request.priority, self._admitted_at[request.request_id]

    def _prefill_chunk(self, request: Request, budget: int) -> int:
        """Tokens of a running request's prefill to schedule: cut to the budget and, so as not to
        preempt needlessly, to the free pages (a page's worth when none is free)."""
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        if self.config.deterministic:
            n = self._fixed_chunk(request.num_computed_tokens, remaining)
            return n if n <= budget else 0
        fit = self.cache.num_allocatable_tokens(request)
        return min(remaining, budget, fit if fit > 0 else self.page_size)

    def _fixed_chunk(self, start: int, remaining: int) -> int:
        """Deterministic mode's prefill chunk from prompt position `start`: up to the next
        multiple of a fixed size, so a prompt is cut at the same places whatever else runs (the
        attention path a chunk takes depends on its length). The size leaves room for every other
        running sequence's decode, so the most important prefill always has its chunk."""
        size = self.config.max_num_batched_tokens - self.config.max_num_seqs + 1
        return min(remaining, size - start % size)

    def _make_room(self, request: Request, n: int, step: _Step) -> bool:
        """Get pages for n more tokens of a running request, preempting less important running
        requests not yet in this step. False if the request itself had to go."""
        while not self.cache.allocate(request, n):
            victim = max((r for r in self.running if r not in step), key=self._victim_key)
            if victim is request and (self.cache.pages_for(request.num_computed_tokens + n)
                                      > self.cache.num_usable_pages):
                self._end(request, RequestStatus.FINISHED_ERROR)
                return False
            self._preempt(victim)
            step.preempted.append(victim)
            step.short_of_pages = True
            if victim is request:
                return False
        return True

    def _preempt_for_priority(self, step: _Step) -> None:
        """Make room for the head of the queue by preempting running requests of strictly lower
        priority, when it has no sequence slot or not a single free page."""
        held = self._pages_by_tenant()
        while self.waiting and self.running:
            head = self.waiting.peek()
            victim = max(self.running, key=self._victim_key)
            if victim.priority <= head.priority or (
                    self.cache.pages_for(head.num_tokens) > self.cache.num_usable_pages) or (
                    self._over_budget(head, 1, held)):
                return
            if (len(self.running) < self.config.max_num_seqs and
                    self.cache.num_allocatable_tokens(head, self.cache.lookup_prefix(head)) > 0):
                return
            self._preempt(victim)
            step.preempted.append(victim)

    def _read_ahead(self) -> None:
        """The disk tier reads the files of the next waiting requests' prefixes while the step
        runs (their admission then finds the pages read)."""
        if self.cache.host_tier is not None and self.cache.host_tier.disk is not None:
            self.cache.read_ahead(list(itertools.islice(self.waiting, READ_AHEAD_REQUESTS)))

    def _admit_waiting(self, step: _Step) -> None:
        in_flight = self.cache.pages_in_flight(self.running) if self.waiting else set()
        held = self._pages_by_tenant()
        with self.waiting.admission_pass() as order:
            for request in order:
                if step.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                if request in step.preempted:
                    order.pass_over(request)
                    continue
                if self.cache.pages_for(request.num_tokens) > self.cache.num_usable_pages:
                    self._end(request, RequestStatus.FINISHED_ERROR)
                    continue
                # A request scoring its prompt computes every position of it itself.
                if not request.scores_prompt:
                    self.cache.restore_prefix(request)
                cached = [] if request.scores_prompt else self.cache.lookup_prefix(request)
                if not request.scores_prompt and self.cache.next_page_in_flight(
                        request, cached, in_flight):
                    order.pass_over(request)  # admit it once that page is cached
                    continue
                remaining = request.num_tokens - len(cached) * self.page_size
                n = min(remaining, step.budget,
                        self.cache.num_allocatable_tokens(request, cached))
                # Nothing running frees pages: the pins give way (they would stall it for their TTL).
                while (n <= 0 or (n < remaining and not self.config.enable_chunked_prefill)) \
                        and not self.running and self.cache.release_oldest_pin():
                    cached = [] if request.scores_prompt else self.cache.lookup_prefix(request)
                    remaining = request.num_tokens - len(cached) * self.page_size
                    n = min(remaining, step.budget,
                            self.cache.num_allocatable_tokens(request, cached))
                if self.config.deterministic and n > 0:  # its first chunk whole, or it waits
                    chunk = self._fixed_chunk(len(cached) * self.page_size, remaining)
                    n = chunk if n >= chunk else 0
                if n <= 0 or (n < remaining and not self.config.enable_chunked_prefill):
                    break  # the queue waits for room in order; nobody overtakes for lack of pages
                pages = self.cache.pages_for(len(cached) * self.page_size + n)
                if self._over_budget(request, pages, held):
                    order.pass_over(request)
                    continue
                order.admit(request)
                self._start(request, cached, n, step)
                held[request.tenant] = held.get(request.tenant, 0) + pages
                in_flight |= self.cache.pages_in_flight([request])

    def _start(self, request: Request, cached: list[int], n: int, step: _Step) -> None:
        admitted = self.cache.admit(request, cached, n)
        assert admitted, "num_allocatable_tokens promised room"
        if request.status == RequestStatus.WAITING:
            request.num_cached_prompt_tokens = min(request.num_computed_tokens,
                                                   request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        self._admitted_at[request.request_id] = self._num_admissions
        self._num_admissions += 1
        self.running.append(request)
        step.add(request, n)

    def _pages_by_tenant(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.page_table)
        return held

    def _over_budget(self, request: Request, pages: int, held: dict[str, int]) -> bool:
        """Whether admitting the request with `pages` pages would take its tenant past its KV
        page budget (a tenant holding no page may always start one request)."""
        if request.kv_page_fraction is None or not held.get(request.tenant):
            return False
        budget = max(1, int(request.kv_page_fraction * self.cache.num_usable_pages))
        return held[request.tenant] + pages > budget

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        del self._admitted_at[request.request_id]
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _end(self, request: Request, status: RequestStatus) -> None:
        self.finish_request(request.request_id, status)
        self._finished.append(request)

    def _expire(self, now: float) -> None:
        """End the requests whose deadline passed, and those not started by their queue
        deadline."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            when, _, request_id, queue_only = heapq.heappop(heap)
            r = self._requests.get(request_id)
            if r is None:
                continue  # ended already
            if queue_only:
                if r.queue_deadline == when and r.status == RequestStatus.WAITING:
                    self._end(r, RequestStatus.FINISHED_QUEUE_TIMEOUT)
            elif r.deadline == when:
                self._end(r, RequestStatus.FINISHED_DEADLINE)
        if len(heap) > 2 * len(self._requests) + 64:  # mostly requests that ended in time
            self._deadlines = [e for e in heap if e[2] in self._requests]
            heapq.heapify(self._deadlines)
