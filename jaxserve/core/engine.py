"""LLMEngine: the step loop (scheduler -> runner -> stops -> outputs), and the offline `LLM` API.

One user request with n > 1 becomes n scheduler requests over the same prompt; the prefix cache
makes them share the prompt's full pages (the scheduler computes a shared page once). The engine
owns what the scheduler leaves to it: when a sequence stops (EOS, stop token ids, stop strings on
the detokenized text, max_tokens, max_model_len), text (incremental detokenization, holding back
a tail that could still become a stop string), logprobs and the counters behind the metrics.

A request with `structured_outputs` has its constraint compiled in `prepare` (a constraint the
grammar library cannot enforce is an InvalidRequest there, before anything runs) and each of its
sequences holds a matcher. A step enqueues the forward, fills the token bitmask of the constrained
rows on the host while the device computes, then samples with it; each sampled token advances
the matcher, and a sequence whose grammar is complete finishes with "stop". Steps without a
constrained row skip the bitmask altogether.

With speculative decoding (EngineConfig.speculative) the scheduler asks `_draft` for n-gram drafts
(jaxserve.core.speculation) for decodes with room to spare; each draft position gets its own logits row
and sampling row, and the tokens drawn there decide which drafts stand (`_on_tokens`).

Every request ends exactly once: `step()` returns one final RequestOutput (finished=True) for it,
whether it stopped, ran out of length or was aborted, and by then all its pages are back. A request
that runs out of time (its QoS deadline: finish_reason "deadline"; its queue deadline, when none
of its sequences has started: "queue_timeout") or is shed from a full queue ("shed", see `shed`) ends as a whole: all its n
sequences end together with that reason.
The engine is single-threaded; `jaxserve.core.async_engine.AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.errors import ContextLengthExceeded, InvalidRequest
from jaxserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from jaxserve.core.request import QoS, Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams, SamplingRow
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.speculation import NgramProposer
from jaxserve.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

_FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "abort",
                  RequestStatus.FINISHED_DEADLINE: "deadline",
                  RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
                  RequestStatus.FINISHED_SHED: "shed"}
# Outcomes that end every sequence of the request, whichever sequence met them first.
_WHOLE_REQUEST = frozenset({RequestStatus.FINISHED_DEADLINE, RequestStatus.FINISHED_QUEUE_TIMEOUT,
                            RequestStatus.FINISHED_SHED})


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


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for `add_request` (built by `prepare`, which may run on another
    thread than the engine: it touches only the tokenizer and the configs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    qos: QoS = QoS()
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled

    @property
    def priority(self) -> int:
        return self.qos.priority


@dataclass(eq=False)
class _Sequence:
    index: int
    request: Request  # the scheduler's
    seed: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    matcher: GrammarMatcher | None = None  # where the sequence is in its grammar, if constrained
    text: str = ""  # what is shown: the detokenized text, cut at a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class _Group:
    """One user request: its n sequences."""

    prepared: PreparedRequest
    metrics: RequestMetrics
    seqs: list[_Sequence] = field(default_factory=list)
    holdback: int = 0  # trailing chars not shown while running: a stop string may still form
    error: Exception | None = None  # set when the request failed on its own (see _fail)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


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
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0)
        self.grammars = GrammarCompiler(tokenizer, vocab_size=config.model.vocab_size,
                                        eos_token_ids=self.eos_token_ids)
        started = time.perf_counter()
        if warmup:
            self.runner.warmup(progress)
        # Time to ready, for the start-up line: compiling (or loading from the persistent
        # compilation cache) every program; the engine factory adds the weights' load time.
        self.compile_seconds = time.perf_counter() - started
        self.load_seconds = 0.0
        self._groups: dict[str, _Group] = {}
        self._by_seq: dict[str, tuple[_Group, _Sequence]] = {}
        self._pending: list[RequestOutput] = []  # final outputs of aborts, sent with the next step
        self._seq_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_finished = 0

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def close(self) -> None:
        """Free the device memory (weights, KV cache, programs); the engine is unusable after."""
        self.runner.close()

    # ---- requests in -------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | dict | Sequence[int],
                params: SamplingParams | None = None, priority: int = 0, *,
                qos: QoS | None = None) -> PreparedRequest:
        """Validate a request without touching engine state: InvalidRequest or
        ContextLengthExceeded for anything that could never run (a structured-output constraint
        is compiled here, on the caller's thread). `qos` (tenant, class, weight, deadlines) comes
        from the gateway; without it, `priority` alone (lower first)."""
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
        max_len = self.max_model_len
        if len(ids) > max_len:
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens but max_model_len is {max_len}", "prompt")
        params = self.fit_kv_pool([len(ids)], params)
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return PreparedRequest(request_id, text, ids, params, qos, grammar)

    @property
    def num_usable_pages(self) -> int:
        """Usable pages of the KV pool (the null page excluded)."""
        return self.runner.num_pages - 1

    def fit_kv_pool(self, prompt_lens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Check a request of several prompts, each run `params.n` times, against what the KV pool
        can ever hold: all its sequences at their longest at once, so one request can never ask
        for more than the whole pool (ContextLengthExceeded at once, never a queue forever).
        A missing max_tokens becomes as many as the context and the sequences' even share of the
        pool allow. Returns params with max_tokens set."""
        page_size, pool = self.config.cache.page_size, self.num_usable_pages
        max_len = self.max_model_len
        seqs = params.n * len(prompt_lens)
        if params.max_tokens is None:
            share = pool // seqs * page_size
            params = params.replace(max_tokens=max(1, min(max_len, share) - max(prompt_lens)))
        pages = params.n * sum(-(-min(p + params.max_tokens, max_len) // page_size)
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
        if prepared.request_id in self._groups:
            raise InvalidRequest(f"request id {prepared.request_id!r} is already in use",
                                 "request_id")
        p = prepared.params
        group = _Group(prepared, RequestMetrics(time.monotonic()))
        # A stop string can end anywhere in the text, so its length - 1 last characters stay
        # unshown until the next token proves they do not start one.
        if p.stop and not p.include_stop_str_in_output:
            group.holdback = max(len(s) for s in p.stop) - 1
        q = prepared.qos
        for i in range(p.n):
            request = Request(f"{next(self._seq_ids)}:{prepared.request_id}",
                              list(prepared.prompt_token_ids), p,
                              arrival_time=group.metrics.arrival_time, priority=q.priority,
                              tenant=q.tenant, weight=q.weight,
                              kv_page_fraction=q.kv_page_fraction, deadline=q.deadline,
                              queue_deadline=q.queue_deadline, max_tokens=p.max_tokens,
                              cache_salt=q.cache_salt)
            detok = IncrementalDetokenizer(self.tokenizer,
                                           skip_special_tokens=p.skip_special_tokens,
                                           prompt_ids=prepared.prompt_token_ids)
            group.seqs.append(_Sequence(i, request, p.sequence_seed(i), detok,
                                        [] if p.logprobs is not None else None,
                                        prepared.grammar.matcher(p.structured_outputs.param)
                                        if prepared.grammar else None))
        # The n sequences enter the scheduler's queue in one step.
        self.scheduler.add_requests([seq.request for seq in group.seqs])
        for seq in group.seqs:
            self._by_seq[seq.request.request_id] = (group, seq)
        self._groups[prepared.request_id] = group

    def abort(self, request_id: str) -> bool:
        """End a request now; its final output (finish_reason "abort") comes with the next step.
        False if it is unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        self._end_group(group, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self._close(group))
        return True

    def abort_sequence(self, request_id: str, index: int) -> bool:
        """End one of a request's n sequences now (finish_reason "abort"), its pages back at
        once; its siblings go on (the front end's output filter ended that choice alone).
        Ending the last one ends the request, whose final output comes with the next step.
        False if the request or the sequence is unknown or already finished."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.seqs) \
                or group.seqs[index].finish_reason is not None:
            return False
        self._end_sequence(group.seqs[index], RequestStatus.FINISHED_ABORTED)
        if group.finished:
            self._pending.append(self._close(group))
        return True

    def shed(self, below: int, num_seqs: int) -> list[str]:
        """Make room in a full queue for a request of priority `below`: end waiting requests of
        less important priorities that have not started (none of their sequences was ever
        admitted), in `Scheduler.shed_order`, until at least num_seqs sequences are gone or none
        is left. Returns their ids; their final outputs (finish_reason "shed", nothing
        generated) come with the next step."""
        chosen: dict[str, _Group] = {}
        freed = 0
        for request in self.scheduler.shed_order(below):
            if freed >= num_seqs:
                break
            group, _ = self._by_seq[request.request_id]
            rid = group.prepared.request_id
            if rid not in chosen and all(s.finish_reason is None and
                                         s.request.status == RequestStatus.WAITING
                                         for s in group.seqs):
                chosen[rid] = group
                freed += len(group.seqs)
        for group in chosen.values():  # after iterating: ending changes the queue
            self._end_group(group, RequestStatus.FINISHED_SHED)
            self._pending.append(self._close(group))
        return list(chosen)

    def has_unfinished(self) -> bool:
        return bool(self._groups) or bool(self._pending)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that changed."""
        changed: dict[str, _Group] = {}
        out = self.scheduler.schedule()
        for request in self.scheduler.take_finished():
            entry = self._by_seq.get(request.request_id)
            if entry is None:  # a sibling's outcome ended it earlier in this loop
                continue
            group, seq = entry
            self._finish(seq, _FINISH_REASON[request.status])
            if request.status in _WHOLE_REQUEST:
                self._end_group(group, request.status)
            changed[group.prepared.request_id] = group
        if out is not None:
            now = time.monotonic()
            rows, constrained = [], []
            first_row: dict[str, int] = {}  # request id -> its first logits row
            for s in out.scheduled:
                group, seq = self._by_seq[s.request.request_id]
                if group.metrics.first_scheduled_time is None:
                    group.metrics.first_scheduled_time = now
                    for sibling in group.seqs:  # the request started: no longer "queued"
                        sibling.request.queue_deadline = None
                first_row[s.request.request_id] = len(rows)
                if not s.samples:
                    rows.append(None)
                    continue
                if seq.matcher is not None:
                    constrained.append((seq.matcher, s.draft_token_ids, len(rows)))
                # A draft's row samples the token after it as if it stood (the penalties, the
                # min_tokens mask and the seeded draw of that output position): see _on_tokens.
                output = s.request.output_token_ids
                for j in range(s.num_rows):
                    rows.append(SamplingRow(group.prepared.params, seq.seed,
                                            s.request.prompt_token_ids,
                                            output + list(s.draft_token_ids[:j]) if j else output))
            logits = self.runner.forward(out.plan)  # enqueued: the host goes on meanwhile
            result = None
            if any(r is not None for r in rows):
                result = self.runner.sample(logits, rows,
                                            self._token_bitmask(constrained, logits.shape[0]))
            sampled = result.token_ids if result is not None else ()
            now = time.monotonic()
            for request, tokens in self.scheduler.update_from_output(out, sampled):
                entry = self._by_seq.get(request.request_id)
                if entry is None:  # a sibling failed earlier in this loop and ended it
                    continue
                group, seq = entry
                try:
                    self._on_tokens(group, seq, tokens, result, first_row[request.request_id],
                                    now)
                except Exception as e:  # noqa: BLE001 - one request's bug must not end the rest
                    log.exception("request %s failed", group.prepared.request_id)
                    self._fail(group, e)
                    changed.pop(group.prepared.request_id, None)
                    continue
                changed[group.prepared.request_id] = group
        outputs, self._pending = self._pending, []
        for group in changed.values():
            outputs.append(self._close(group) if group.finished else self._output(group))
        return outputs

    def _draft(self, request: Request, n: int) -> list[int]:
        """The scheduler's drafter: up to n draft tokens for a decode (the request's own
        num_speculative_tokens caps it; 0 opts out)."""
        group, _ = self._by_seq[request.request_id]
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

    def _on_tokens(self, group: _Group, seq: _Sequence, tokens: list[int], result, row: int,
                   now: float) -> None:
        """The step's new tokens of one sequence, in order (several when drafts stood), from
        logits row `row` on. A sequence that stops at one of them (EOS, a stop string, max_tokens,
        its grammar's end) drops the ones after it, as if they had never been drawn.

        Why the drafts' verification leaves outputs as they would be without speculation: each
        row draws its token from the distribution the non-speculative step at that position
        would use (same penalties, min_tokens mask, grammar state and seeded uniforms), and a
        draft stands iff the token drawn at its row equals it. For a deterministic draft d, that
        accepts d with probability p(d) and otherwise yields a draw from p with d removed and
        renormalised: the rejection sampling rule for a point-mass proposal, coupled so that
        the emitted token is the very token the plain step would have drawn."""
        request = seq.request
        first = len(request.output_token_ids) - len(tokens)
        for j, token in enumerate(tokens):
            num_out = first + j + 1
            if self._on_token(group, seq, token, result, row + j, now, num_out):
                del request.output_token_ids[num_out:]
                return

    def _on_token(self, group: _Group, seq: _Sequence, token: int, result, row: int,
                  now: float, num_out: int) -> bool:
        """One new token (the num_out-th of the output); True when the sequence stopped."""
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self._prompt_tokens += len(group.prepared.prompt_token_ids)
        m.last_token_time = now
        self._generation_tokens += 1
        p = group.prepared.params
        if seq.logprobs is not None:
            k = p.logprobs
            top = list(zip(result.top_token_ids[row, :k].tolist(),
                           result.top_logprobs[row, :k].tolist()))
            seq.logprobs.append(TokenLogprob(float(result.logprobs[row]), top))
        if seq.matcher is not None:
            seq.matcher.accept(token)  # a refusal raises: this request fails alone
        stop_token = num_out > p.min_tokens - 1 and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids)
        if stop_token:
            if token in p.stop_token_ids:
                seq.stop_reason = token
            if p.include_stop_str_in_output:
                seq.detokenizer.add(token)
            self._stop(seq, "stop", seq.detokenizer.text + seq.detokenizer.finish())
            return True
        shown = len(seq.detokenizer.text)
        seq.detokenizer.add(token)
        if p.stop and num_out >= p.min_tokens:
            # Only a stop string ending in the new characters can be new.
            text = seq.detokenizer.text
            hit = _find_stop(text, p.stop, max(0, shown - max(map(len, p.stop)) + 1))
            if hit is not None:
                at, stop = hit
                seq.stop_reason = stop
                end = at + len(stop) if p.include_stop_str_in_output else at
                self._stop(seq, "stop", text[:end])
                return True
        if seq.matcher is not None and seq.matcher.is_finished:
            # The grammar admits nothing more (min_tokens cannot outlast it).
            self._stop(seq, "stop", seq.detokenizer.text + seq.detokenizer.finish())
            return True
        if (num_out >= p.max_tokens
                or seq.request.num_prompt_tokens + num_out >= self.max_model_len):
            self._stop(seq, "length", seq.detokenizer.text + seq.detokenizer.finish())
            return True
        text = seq.detokenizer.text
        seq.text = text[:len(text) - group.holdback] if group.holdback else text
        return False

    def _fail(self, group: _Group, error: Exception) -> None:
        """End a request whose host-side processing raised: its pages go back, and its final
        output carries the error: the front ends answer that request alone, with its typed
        status (a constraint the tokenizer cannot follow is a 400) or else a 500."""
        group.error = error
        self._end_group(group, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self._close(group))

    def _end_group(self, group: _Group, status: RequestStatus) -> None:
        """End the request's unfinished sequences with `status`; their pages go back."""
        for seq in group.seqs:
            if seq.finish_reason is None:
                self._end_sequence(seq, status)

    def _stop(self, seq: _Sequence, reason: str, text: str) -> None:
        seq.text = text
        self._end_sequence(seq, RequestStatus.FINISHED_STOPPED if reason == "stop"
                           else RequestStatus.FINISHED_LENGTH)

    def _end_sequence(self, seq: _Sequence, status: RequestStatus) -> None:
        """The scheduler frees the sequence's pages; it is finished with status's reason."""
        self.scheduler.finish_request(seq.request.request_id, status)
        self._finish(seq, _FINISH_REASON[status])

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.matcher = None
        del self._by_seq[seq.request.request_id]

    # ---- outputs -----------------------------------------------------------------------------

    def _output(self, group: _Group) -> RequestOutput:
        """A snapshot: the consumer may be another thread while the engine goes on."""
        prepared = group.prepared
        outs = [CompletionOutput(s.index, s.text, list(s.request.output_token_ids),
                                 s.finish_reason, s.stop_reason,
                                 list(s.logprobs) if s.logprobs is not None else None)
                for s in group.seqs]
        return RequestOutput(prepared.request_id, prepared.prompt, prepared.prompt_token_ids, outs,
                             group.finished, group.seqs[0].request.num_cached_prompt_tokens,
                             group.metrics, group.error)

    def _close(self, group: _Group) -> RequestOutput:
        group.metrics.finished_time = time.monotonic()
        del self._groups[group.prepared.request_id]
        self._num_finished += 1
        return self._output(group)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(s.num_running, s.num_waiting, s.pages_in_use, s.pages_cached_free,
                           s.num_usable_pages, s.prefix_cache_queries, s.prefix_cache_hits,
                           s.num_preemptions, self._prompt_tokens, self._generation_tokens,
                           self._num_finished, s.num_new_by_priority, s.num_draft_tokens,
                           s.num_accepted_draft_tokens)


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in text[start:] (the only part new tokens can complete one in)."""
    best = None
    for s in stops:
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best
