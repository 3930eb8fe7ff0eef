"""LLMEngine: the step loop (scheduler -> runner -> output processing -> outputs).

One user request with n > 1 becomes n scheduler requests over the same prompt; the prefix cache
makes them share the prompt's full pages (the scheduler computes a shared page once). What the
sampled tokens do (stops, detokenization, logprobs, finishing, the RequestOutputs) is
`jaxserve.core.output_processing`'s.

A request with `structured_outputs` has its constraint compiled in `prepare` (a constraint the
grammar library cannot enforce is an InvalidRequest there, before anything runs) and each of its
sequences holds a matcher. A step enqueues the forward, fills the token bitmask of the constrained
rows on the host while the device computes, then samples with it; each sampled token advances
the matcher, and a sequence whose grammar is complete finishes with "stop". Steps without a
constrained row skip the bitmask altogether.

With speculative decoding (EngineConfig.speculative) the scheduler asks `_draft` for n-gram drafts
(jaxserve.core.speculation) for decodes with room to spare; each draft position gets its own logits
row and sampling row, and the tokens drawn there decide which drafts stand (see
OutputProcessor._on_tokens).

Every request ends exactly once: `step()` returns one final RequestOutput (finished=True) for it,
whether it stopped, ran out of length or was aborted, and by then all its pages are back. A request
that runs out of time (its QoS deadline: finish_reason "deadline"; its queue deadline, when none
of its sequences has started: "queue_timeout") or is shed from a full queue ("shed", see `shed`)
ends as a whole: all its n sequences end together with that reason.
The engine is single-threaded; `jaxserve.core.async_engine.AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.errors import Conflict, ContextLengthExceeded, InvalidRequest
from jaxserve.core.kv_disk import disk_tier
from jaxserve.core.output_processing import OutputProcessor
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.request import QoS, Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.core.speculation import NgramProposer
from jaxserve.core.step_gaps import StepGaps
from jaxserve.executor.batch_plan import pages_for
from jaxserve.executor.sampling_rows import SamplingRow
from jaxserve.structured.grammar import GrammarCompiler, GrammarMatcher
from jaxserve.tokenizer import Tokenizer


# What a sleeping engine has put away (vLLM's wake_up tags).
SLEEP_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    pages_in_use: int  # held by live requests
    pages_cached_free: int  # held only by the prefix cache
    num_usable_pages: int  # the pool less the null page
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of requests that produced their first token
    generation_tokens: int
    num_requests_finished: int
    num_new_by_priority: dict[int, int]  # waiting sequences never admitted (sheddable)
    num_draft_tokens: int = 0  # speculative tokens proposed and verified
    num_accepted_draft_tokens: int = 0  # of which the model confirmed
    # A mixture of experts (jaxserve.executor.expert_load): token copies routed to each expert
    # since start, summed over the sparse layers; the steps they cover; the devices the experts
    # are spread over, E / n contiguous ones each.
    expert_tokens: tuple[int, ...] = ()
    expert_steps: int = 0
    expert_parallel_size: int = 1
    # The prefix cache's host tier (--kv-offloading-size; jaxserve.core.kv_offload): prompt
    # tokens of full pages looked up past the device's hits and those restored; pages held and
    # the pool's size in pages; bytes copied each way; host seconds spent on the copies.
    kv_offload_queries: int = 0
    kv_offload_hits: int = 0
    kv_offload_pages: int = 0
    kv_offload_capacity_pages: int = 0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_seconds: float = 0.0
    # Its disk tier (--kv-offloading-disk-path; jaxserve.core.kv_disk): of the hits, those read
    # from disk; files held and the bound; bytes written to and read from the files; the engine
    # thread's seconds on them (queueing writes, waiting for reads, loading pages: the files
    # are written, read and checked on the tier's worker thread).
    kv_disk_hits: int = 0
    kv_disk_pages: int = 0
    kv_disk_capacity_pages: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_seconds: float = 0.0
    # Prompt-cache pins (Anthropic's cache_control): held now, their pages, expired in all.
    num_pins: int = 0
    pinned_pages: int = 0
    pins_expired: int = 0
    # The host's gaps between steps (jaxserve.core.step_gaps): how many were measured, their
    # seconds, and the steps launched before the previous one finished (async scheduling).
    num_step_gaps: int = 0
    step_gap_seconds: float = 0.0
    num_steps_queued_ahead: int = 0


class _SamplingRows(NamedTuple):
    """A step's sampling rows, one per logits row of its plan."""

    rows: list[SamplingRow | None]  # None: the row of a prefill chunk that does not sample
    constrained: list[tuple[GrammarMatcher, Sequence[int], int]]  # (matcher, drafts, first row)
    first_row: dict[str, int]  # scheduler request id -> its first logits row


@dataclass(eq=False)
class _Launched:
    """A step on the device, until its tokens are processed."""

    out: SchedulerOutput
    rows: _SamplingRows
    pending: object | None  # the runner's PendingStep; None when no row samples
    chunks: list  # its prefill chunks, ended when its tokens are read
    overlaps: bool  # stays in flight while the next step is launched
    # While in flight: update_from_output's (request, placeholders), resolved once read.
    new_tokens: list | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, params: dict, tokenizer: Tokenizer, *, mesh=None,
                 strict_compile: bool = False, warmup: bool = True, progress: bool = True,
                 publish=None):
        """mesh: this replica's devices (tensor parallel), params sharded on it; publish: see
        ModelRunner (multi-host)."""
        from jaxserve.executor.runner import ModelRunner

        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(config.model.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids)
        spec = config.speculative
        self.runner = ModelRunner(config.model, params, config.cache, config.scheduler,
                                  eos_token_ids=self.eos_token_ids, mesh=mesh,
                                  strict=strict_compile, publish=publish,
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0)
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_pages,
            drafter=self._draft if spec is not None else None,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            num_host_pages=self.runner.num_host_pages,
            disk_tier=(disk_tier(config.cache, self.runner.host_pool.page_bytes)
                       if self.runner.host_pool is not None else None))
        self.output_processor = OutputProcessor(self.scheduler, tokenizer, self.eos_token_ids,
                                                self.max_model_len)
        self.grammars = GrammarCompiler(tokenizer, vocab_size=config.model.vocab_size,
                                        eos_token_ids=self.eos_token_ids)
        self._in_flight: _Launched | None = None  # launched, its tokens not read yet
        self.gaps = StepGaps()
        started = time.perf_counter()
        if warmup:
            self.runner.warmup(progress)
        # Time to ready, for the start-up line: compiling (or loading from the persistent
        # compilation cache) every program; the engine factory adds the weights' load time.
        self.compile_seconds = time.perf_counter() - started
        self.load_seconds = 0.0

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def close(self) -> None:
        """Free the device memory (weights, KV cache, programs); the engine is unusable after."""
        self.runner.close()

    # ---- sleep (POST /sleep, /wake_up) ---------------------------------------------------------

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """What sleeps: "kv_cache" (the pool is freed), "weights" (in host memory); empty: awake."""
        return self.runner.sleeping_tags

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV pool (its prefix cache is forgotten), level 2 also moves the
        weights to host memory; the compiled programs stay. Only while no request is live
        (Conflict otherwise), and not for a multi-host group (its followers hold the rest)."""
        if level not in (1, 2):
            raise InvalidRequest(f"level must be 1 or 2, got {level!r}", "level")
        if self.runner.publish is not None:
            raise Conflict("a multi-host engine cannot sleep")
        if self.has_unfinished():  # a live request, an output not yet handed out, a step
            raise Conflict("requests are still running; a version sleeps once they end")
        self.scheduler.cache.forget_contents()
        self.runner.sleep_kv_cache()
        if level == 2:
            self.runner.sleep_weights()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what `tags` name ("weights", "kv_cache"; None: all); waking what is awake
        does nothing."""
        tags = set(SLEEP_TAGS if tags is None else tags)
        if not tags <= set(SLEEP_TAGS):
            raise InvalidRequest(f"tags are {', '.join(SLEEP_TAGS)}; got "
                                 f"{', '.join(sorted(tags - set(SLEEP_TAGS)))}", "tags")
        if "weights" in tags:
            self.runner.wake_weights()
        if "kv_cache" in tags:
            self.runner.wake_kv_cache()

    # ---- requests in -------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | dict | Sequence[int],
                params: SamplingParams | None = None, priority: int = 0, *,
                qos: QoS | None = None, fitted: bool = False) -> PreparedRequest:
        """Validate a request without touching engine state: InvalidRequest or
        ContextLengthExceeded for anything that could never run (a structured-output constraint
        is compiled here, on the caller's thread). `qos` (tenant, class, weight, deadlines) comes
        from the gateway; without it, `priority` alone (lower first). The prompt is checked
        against the context and the KV pool (`check_fits`) unless `fitted`: params come from
        check_fits over the whole request this prompt belongs to (the serving path checks all of
        a request's prompts at once)."""
        if qos is None:
            qos = QoS(priority=priority)
        elif priority not in (0, qos.priority):
            raise InvalidRequest("give the priority in qos, not both", "priority")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got "
                                 f"{type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequest("the prompt must contain at least one token", "prompt")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                 "prompt")
        if not fitted:
            params = self.check_fits([len(ids)], params)
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return PreparedRequest(request_id, text, ids, params, qos, grammar)

    @property
    def num_usable_pages(self) -> int:
        """Usable pages of the KV pool (the null page excluded)."""
        return self.runner.num_pages - 1

    def check_fits(self, prompt_lens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """The one check that a request of several prompts, each run `params.n` times, can ever
        run: every prompt within max_model_len, and all its sequences at their longest at once
        within the KV pool, so one request can never ask for more than the whole pool
        (ContextLengthExceeded at once, never a queue forever). A missing max_tokens becomes as
        many as the context and the sequences' even share of the pool allow. Returns params with
        max_tokens set. Reads only the configs: safe from any thread."""
        page_size, pool = self.config.cache.page_size, self.num_usable_pages
        max_len = self.max_model_len
        longest = max(prompt_lens, default=0)
        if longest > max_len:
            raise ContextLengthExceeded(
                f"the prompt has {longest} tokens but max_model_len is {max_len}", "prompt")
        seqs = params.n * len(prompt_lens)
        if params.max_tokens is None:
            share = pool // seqs * page_size
            params = params.replace(max_tokens=max(1, min(max_len, share) - longest))
        pages = params.n * sum(pages_for(min(p + params.max_tokens, max_len), page_size)
                               for p in prompt_lens)
        if pages > pool:
            what = "" if seqs == 1 else f" for its {seqs} sequences"
            param = "max_tokens" if seqs == 1 else "n" if params.n > 1 else "prompt"
            raise ContextLengthExceeded(
                f"the request needs {pages} KV pages{what} but the pool has {pool}", param)
        return params

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if isinstance(prompt.get("prompt"), str):
                return self._prompt_ids(prompt["prompt"])
            raise InvalidRequest("a prompt dict needs 'prompt' (str) or 'prompt_token_ids'",
                                 "prompt")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest(f"a prompt is a string, a list of token ids or a dict, got "
                             f"{type(prompt).__name__}", "prompt")

    def add_request(self, request_id: str, prompt: str | dict | Sequence[int] | None = None,
                    params: SamplingParams | None = None, priority: int = 0, *,
                    qos: QoS | None = None, prepared: PreparedRequest | None = None) -> None:
        if prepared is None:
            prepared = self.prepare(request_id, prompt, params, priority, qos=qos)
        if prepared.request_id in self.output_processor.groups:
            raise InvalidRequest(f"request id {prepared.request_id!r} is already in use",
                                 "request_id")
        self.add_prepared(prepared)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request whose id its caller has checked is not in use (AsyncEngine:
        its open streams)."""
        assert prepared.request_id not in self.output_processor.groups, "request ids are unique"
        group = self.output_processor.new_group(prepared)
        # The n sequences enter the scheduler's queue in one step.
        self.scheduler.add_requests([seq.request for seq in group.seqs])
        self.output_processor.add(group)

    def abort(self, request_id: str) -> bool:
        """End a request now; its final output (finish_reason "abort") comes with the next step.
        False if it is unknown or already finished."""
        group = self.output_processor.groups.get(request_id)
        if group is None:
            return False
        self.output_processor.end_request(group, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_sequence(self, request_id: str, index: int) -> bool:
        """End one of a request's n sequences now (finish_reason "abort"), its pages back at
        once; its siblings go on (the front end's output filter ended that choice alone).
        Ending the last one ends the request, whose final output comes with the next step.
        False if the request or the sequence is unknown or already finished."""
        group = self.output_processor.groups.get(request_id)
        if group is None or not 0 <= index < len(group.seqs) \
                or group.seqs[index].finish_reason is not None:
            return False
        self.output_processor.end_sequence(group, index, RequestStatus.FINISHED_ABORTED)
        return True

    def shed(self, below: int, num_seqs: int) -> list[str]:
        """Make room in a full queue for a request of priority `below`: end waiting requests of
        less important priorities that have not started (none of their sequences was ever
        admitted), in `Scheduler.shed_order`, until at least num_seqs sequences are gone or none
        is left. Returns their ids; their final outputs (finish_reason "shed", nothing
        generated) come with the next step."""
        chosen = {}
        freed = 0
        for request in self.scheduler.shed_order(below):
            if freed >= num_seqs:
                break
            group, _ = self.output_processor.sequence(request.request_id)
            rid = group.prepared.request_id
            if rid not in chosen and all(s.finish_reason is None and
                                         s.request.status == RequestStatus.WAITING
                                         for s in group.seqs):
                chosen[rid] = group
                freed += len(group.seqs)
        for group in chosen.values():  # after iterating: ending changes the queue
            self.output_processor.end_request(group, RequestStatus.FINISHED_SHED)
        return list(chosen)

    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished() or self._in_flight is not None

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that changed.

        With async scheduling this step is launched first, and the previous step's tokens are
        read and processed while it runs; it stays on the device until the next call (its
        requests hold placeholders for its tokens: see `_launch`)."""
        if self._in_flight is not None and self._in_flight.pending.done():
            self.gaps.ready()
        out = self.scheduler.schedule()
        changed = self.output_processor.collect_finished(self.scheduler.take_finished())
        launched = self._launch(out) if out is not None else None
        if self._in_flight is not None:
            self._finish(self._in_flight, changed)
            self._in_flight = None
        if launched is not None:
            if launched.overlaps:
                launched.new_tokens = self.scheduler.update_from_output(
                    launched.out, -1 - np.arange(len(launched.rows.rows)))
                self._in_flight = launched
            else:
                self._finish(launched, changed)
        if not self.has_unfinished():
            self.gaps.idle()
        return self.output_processor.take_outputs(changed)

    def _launch(self, out: SchedulerOutput) -> _Launched:
        """Launch the step's forward and sampler; the device computes while the host goes on.
        It overlaps the next step (stays in flight) when async scheduling is on and none of its
        sampling rows needs its tokens on the host before the next step can be built: a
        grammar's mask for the next token follows the matcher, penalties read the history, and
        speculative drafts come from the tokens, so such steps are read before the next one is
        scheduled. A step whose rows do not sample is never waited for."""
        chunks = self.output_processor.mark_scheduled(out.scheduled, time.monotonic())
        rows = self._sampling_rows(out)
        self.runner.copy_pages(out.page_copies)  # the host tier's, before the forward
        logits = self.runner.forward(out.plan)  # enqueued: the host goes on meanwhile
        self.gaps.launched(self._in_flight is not None and not self._in_flight.pending.done())
        pending = self._sample(logits, rows)
        self._score_prompts(out)  # before update_from_output moves num_computed_tokens
        overlaps = (self.config.scheduler.async_scheduling and pending is not None
                    and self.proposer is None and not rows.constrained
                    and not any(r is not None and r.params.uses_penalties for r in rows.rows))
        return _Launched(out, rows, pending, chunks, overlaps)

    def _finish(self, launched: _Launched, changed: dict) -> None:
        """Read a launched step's tokens (waiting for the device) and process them."""
        result = launched.pending.result() if launched.pending is not None else None
        if result is not None:
            self.gaps.ready()
        if launched.new_tokens is None:
            new_tokens = self.scheduler.update_from_output(
                launched.out, result.token_ids if result is not None else ())
        else:
            new_tokens = self.scheduler.resolve_placeholders(launched.new_tokens,
                                                             result.token_ids)
        self.output_processor.end_step(launched.chunks, time.monotonic())
        self.output_processor.process_tokens(new_tokens, result, launched.rows.first_row, changed)

    def _sampling_rows(self, out: SchedulerOutput) -> _SamplingRows:
        """A row per logits row: a sampling sequence's last token, and with drafts one per draft
        (each samples the token after it as if it stood: the penalties, the min_tokens mask and
        the seeded draw of that output position; see OutputProcessor._on_tokens)."""
        rows, constrained, first_row = [], [], {}
        for s in out.scheduled:
            group, seq = self.output_processor.sequence(s.request.request_id)
            first_row[s.request.request_id] = len(rows)
            if not s.samples:
                rows.append(None)
                continue
            if seq.matcher is not None:
                constrained.append((seq.matcher, s.draft_token_ids, len(rows)))
            output = s.request.output_token_ids
            for j in range(s.num_rows):
                rows.append(SamplingRow(group.prepared.params, seq.seed,
                                        s.request.prompt_token_ids,
                                        output + list(s.draft_token_ids[:j]) if j else output))
        return _SamplingRows(rows, constrained, first_row)

    def _sample(self, logits, rows: _SamplingRows):
        """The runner's PendingStep for the rows that sample (launched, not waited for); None
        when none does."""
        if all(r is None for r in rows.rows):
            return None
        return self.runner.sample_async(logits, rows.rows,
                                        self._token_bitmask(rows.constrained, logits.shape[0]))

    def _score_prompts(self, out: SchedulerOutput) -> None:
        """Score the prompt positions of this step's chunks whose requests ask for prompt
        logprobs: flat row r at prompt position p gives the logprob of prompt token p + 1. The
        last prompt position predicts the first output token, so it is not scored here. Steps
        without such a chunk run nothing."""
        spans = []  # (scheduler request id, first position, first flat row, count)
        for i, s in enumerate(out.scheduled):
            request = s.request
            if not request.scores_prompt or request.output_token_ids:
                continue  # scored once, before its first token
            start = request.num_computed_tokens
            count = min(start + s.num_tokens, request.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((request, start, int(out.plan.cu_q_lens[i]), count))
        if not spans:
            return
        targets = np.zeros(out.plan.token_ids.shape[0], np.int32)
        for request, start, row, count in spans:
            targets[row:row + count] = request.prompt_token_ids[start + 1:start + 1 + count]
        scores = self.runner.score(targets)
        for request, start, row, count in spans:
            self.output_processor.record_prompt_logprobs(request.request_id, start, scores,
                                                         slice(row, row + count))

    def _draft(self, request: Request, n: int) -> list[int]:
        """The scheduler's drafter: up to n draft tokens for a decode (the request's own
        num_speculative_tokens caps it; 0 opts out)."""
        group, _ = self.output_processor.sequence(request.request_id)
        cap = group.prepared.params.num_speculative_tokens
        n = n if cap is None else min(n, cap)
        return self.proposer.propose(request.all_token_ids, n) if n > 0 else []

    def _token_bitmask(self, constrained: list[tuple[GrammarMatcher, Sequence[int], int]],
                       num_rows: int) -> np.ndarray | None:
        """The allowed tokens of the constrained rows (every token on the others, padding
        included); None when no sampling row is constrained: the step skips the bitmask.
        constrained: (matcher, drafts, first row): a sequence verifying drafts has one row per
        position, each masked in the grammar state after the drafts before it."""
        if not constrained:
            return None
        bitmask = np.full((num_rows, self.runner.bitmask_width), -1, np.int32)
        self.grammars.fill_bitmask([(state, row + j) for matcher, drafts, row in constrained
                                    for j, state in enumerate(matcher.speculate(drafts))],
                                   bitmask)
        return bitmask

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        load = self.runner.expert_load
        expert_tokens, expert_steps = load.totals() if load is not None else ((), 0)
        return EngineStats(s.num_running, s.num_waiting, s.pages_in_use, s.pages_cached_free,
                           s.num_usable_pages, s.prefix_cache_queries, s.prefix_cache_hits,
                           s.num_preemptions, self.output_processor.prompt_tokens,
                           self.output_processor.generation_tokens,
                           self.output_processor.num_finished, s.num_new_by_priority,
                           s.num_draft_tokens, s.num_accepted_draft_tokens, expert_tokens,
                           expert_steps, load.expert_parallel_size if load is not None else 1,
                           s.host_tier_queries, s.host_tier_hits, s.host_tier_pages,
                           s.host_tier_slots, *self._host_pool_counts(), num_pins=s.num_pins,
                           pinned_pages=s.pinned_pages, pins_expired=s.pins_expired,
                           num_step_gaps=self.gaps.num_gaps,
                           step_gap_seconds=self.gaps.gap_seconds,
                           num_steps_queued_ahead=self.gaps.num_queued_ahead,
                           **self._disk_counts(s))

    def _disk_counts(self, s) -> dict:
        if not s.disk_tier_files:
            return {}
        pool = self.runner.host_pool
        return dict(kv_disk_hits=s.disk_tier_hits, kv_disk_pages=s.disk_tier_pages,
                    kv_disk_capacity_pages=s.disk_tier_files,
                    kv_disk_bytes_written=s.disk_tier_bytes_written,
                    kv_disk_bytes_read=pool.bytes_from_disk,
                    kv_disk_seconds=pool.disk_seconds + s.disk_tier_read_seconds)

    def _host_pool_counts(self) -> tuple[int, int, float]:
        pool = self.runner.host_pool
        return (pool.bytes_to_host, pool.bytes_to_device, pool.copy_seconds) if pool else (0, 0, 0.)

