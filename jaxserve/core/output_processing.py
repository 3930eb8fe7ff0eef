"""Output processing: what a step's sampled tokens do to the requests they belong to (host side).

The engine keeps here, per user request, a `SequenceGroup` of its n sequences. For each new token
of a sequence, in order: its logprobs are collected, its grammar matcher advances, and the
sequence stops at EOS or a stop token id (after min_tokens), a stop string in the detokenized text,
its grammar's end, max_tokens or max_model_len. Text is detokenized incrementally; while a
sequence runs, the last characters that could still grow into a stop string stay unshown
(`SequenceGroup.holdback`). A sequence that stops gives its pages back to the scheduler at once.

With speculative decoding a sequence gets several tokens in one step (the drafts that stood and
the token after them); one that stops at one of them drops the ones after it, as if they had never
been drawn (`_on_tokens`).

Every request ends exactly once: one final RequestOutput (finished=True), built by `_close`,
whether it stopped, ran out of length, was aborted or shed, or failed on its own (`_fail`). A
request that runs out of time or is shed ends as a whole: all its n sequences end with that reason.
RequestOutputs are snapshots: the consumer may be another thread while the engine goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from jaxserve.core.outputs import (CompletionOutput, PrefillChunk, PromptLogprob, RequestMetrics,
                                   RequestOutput, TokenLogprob)
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import ScheduledSeq, Scheduler
from jaxserve.structured.grammar import GrammarMatcher
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                 RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "abort",
                 RequestStatus.FINISHED_DEADLINE: "deadline",
                 RequestStatus.FINISHED_QUEUE_TIMEOUT: "queue_timeout",
                 RequestStatus.FINISHED_SHED: "shed"}
# Outcomes that end every sequence of the request, whichever sequence met them first.
WHOLE_REQUEST = frozenset({RequestStatus.FINISHED_DEADLINE, RequestStatus.FINISHED_QUEUE_TIMEOUT,
                           RequestStatus.FINISHED_SHED})


@dataclass(eq=False)
class SequenceState:
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
class SequenceGroup:
    """One user request: its n sequences."""

    prepared: PreparedRequest
    metrics: RequestMetrics
    seqs: list[SequenceState] = field(default_factory=list)
    holdback: int = 0  # trailing chars not shown while running: a stop string may still form
    error: Exception | None = None  # set when the request failed on its own (see _fail)
    # With prompt_logprobs: one per prompt token (the first None), filled as its first sequence's
    # prompt chunks run; shared by every output once complete (entries never change after).
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """The live requests' host-side state, from `new_group` to their final output."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer,
                 eos_token_ids: frozenset[int], max_model_len: int):
        self.scheduler = scheduler  # a finished sequence's pages go back through it
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, SequenceGroup] = {}  # by the user's request id
        self._by_seq: dict[str, tuple[SequenceGroup, SequenceState]] = {}  # by scheduler id
        self._pending: list[RequestOutput] = []  # final outputs of aborts, sent with the next step
        self._seq_ids = itertools.count()
        self.prompt_tokens = 0  # of requests that produced their first token
        self.generation_tokens = 0
        self.num_finished = 0

    # ---- requests in -------------------------------------------------------------------------

    def new_group(self, prepared: PreparedRequest) -> SequenceGroup:
        """The request's n sequences, each with its scheduler Request; `add` them once the
        scheduler has queued those."""
        p = prepared.params
        group = SequenceGroup(prepared, RequestMetrics(time.monotonic()))
        if p.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prepared.prompt_token_ids)
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
                              cache_salt=q.cache_salt,
                              cache_pins=p.cache_pins if i == 0 else (),  # the first pins for all n
                              # The first sequence scores the prompt for all n.
                              scores_prompt=p.prompt_logprobs is not None and i == 0)
            detok = IncrementalDetokenizer(self.tokenizer,
                                           skip_special_tokens=p.skip_special_tokens,
                                           prompt_ids=prepared.prompt_token_ids)
            group.seqs.append(SequenceState(i, request, p.sequence_seed(i), detok,
                                            [] if p.logprobs is not None else None,
                                            prepared.grammar.matcher(p.structured_outputs.param)
                                            if prepared.grammar else None))
        return group

    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._by_seq[seq.request.request_id] = (group, seq)
        self.groups[group.prepared.request_id] = group

    def sequence(self, request_id: str) -> tuple[SequenceGroup, SequenceState]:
        """The group and sequence of a scheduler request id."""
        return self._by_seq[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self._pending)

    # ---- one step ----------------------------------------------------------------------------

    def collect_finished(self, requests: Iterable[Request]) -> dict[str, SequenceGroup]:
        """The requests the scheduler ended itself (`Scheduler.take_finished`): their sequences
        finish with the scheduler's reason (a deadline, queue timeout or shed ends the whole
        request). Returns the groups this changed, by request id."""
        changed: dict[str, SequenceGroup] = {}
        for request in requests:
            entry = self._by_seq.get(request.request_id)
            if entry is None:  # a sibling's outcome ended it earlier in this loop
                continue
            group, seq = entry
            self._finish(seq, FINISH_REASON[request.status])
            if request.status in WHOLE_REQUEST:
                self._end_group(group, request.status)
            changed[group.prepared.request_id] = group
        return changed

    def mark_scheduled(self, scheduled: Sequence[ScheduledSeq], now: float
                       ) -> list[PrefillChunk]:
        """A request's first scheduled step starts it: no longer "queued" (its queue deadline
        no longer applies). The step's prefill chunks are noted, for the request's trace, and
        returned (times only; `end_step` closes them)."""
        chunks = []
        for s in scheduled:
            group, _ = self._by_seq[s.request.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                for sibling in group.seqs:
                    sibling.request.queue_deadline = None
            request = s.request
            if request.num_computed_tokens < request.num_tokens - 1:  # not a plain decode
                chunk = PrefillChunk(now, now, s.num_tokens)
                group.metrics.prefill_chunks.append(chunk)
                chunks.append(chunk)
        return chunks

    @staticmethod
    def end_step(chunks: Sequence[PrefillChunk], now: float) -> None:
        """The step's tokens are sampled: its prefill chunks end now."""
        for chunk in chunks:
            chunk.end = now

    def record_prompt_logprobs(self, request_id: str, first_pos: int, scores, rows: slice
                               ) -> None:
        """Prompt positions first_pos.. of a scoring sequence, scored on `rows` of `scores` (the
        runner's ScoreOutput): row j gives the logprob of prompt token first_pos + j + 1."""
        entry = self._by_seq.get(request_id)
        if entry is None:  # ended since the step was scheduled
            return
        group = entry[0]
        k = group.prepared.params.prompt_logprobs
        ids = group.prepared.prompt_token_ids
        top_ids = scores.top_token_ids[rows, :k].tolist()
        top_lps = scores.top_logprobs[rows, :k].tolist()
        for j, (lp, rank) in enumerate(zip(scores.logprobs[rows].tolist(),
                                          scores.ranks[rows].tolist())):
            pos = first_pos + j + 1
            group.prompt_logprobs[pos] = PromptLogprob(ids[pos], lp, rank,
                                                       list(zip(top_ids[j], top_lps[j])))

    def process_tokens(self, new_tokens: Iterable[tuple[Request, list[int]]], result,
                       first_row: dict[str, int], changed: dict[str, SequenceGroup]) -> None:
        """Each sequence's new tokens (`Scheduler.update_from_output`), sampled from logits rows
        `first_row[id]` on of `result` (the runner's StepOutput); the groups changed go into
        `changed`. A request whose processing raises fails alone (its output carries the error)."""
        now = time.monotonic()
        for request, tokens in new_tokens:
            entry = self._by_seq.get(request.request_id)
            if entry is None:  # ended meanwhile (a deadline, a shed, a sibling's failure):
                # tokens of a step launched before it ended are dropped, as if never drawn,
                # so its final output shows only the tokens counted (generation_tokens)
                del request.output_token_ids[len(request.output_token_ids) - len(tokens):]
                continue
            group, seq = entry
            try:
                self._on_tokens(group, seq, tokens, result, first_row[request.request_id], now)
            except Exception as e:  # noqa: BLE001 - one request's bug must not end the rest
                log.exception("request %s failed", group.prepared.request_id)
                self._fail(group, e)
                changed.pop(group.prepared.request_id, None)
                continue
            changed[group.prepared.request_id] = group

    def take_outputs(self, changed: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """The step's outputs: the final ones of requests ended between steps, then one for each
        changed request (its final one if it finished)."""
        outputs, self._pending = self._pending, []
        for group in changed.values():
            outputs.append(self._close(group) if group.finished else self._output(group))
        return outputs

    def _on_tokens(self, group: SequenceGroup, seq: SequenceState, tokens: list[int], result,
                   row: int, now: float) -> None:
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

    def _on_token(self, group: SequenceGroup, seq: SequenceState, token: int, result, row: int,
                  now: float, num_out: int) -> bool:
        """One new token (the num_out-th of the output); True when the sequence stopped."""
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.prompt_tokens += len(group.prepared.prompt_token_ids)
        m.last_token_time = now
        self.generation_tokens += 1
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
        # (never a negative index: a text shorter than the hold-back shows nothing yet)
        seq.text = text[:max(0, len(text) - group.holdback)] if group.holdback else text
        return False

    # ---- ending ------------------------------------------------------------------------------

    def end_request(self, group: SequenceGroup, status: RequestStatus) -> None:
        """End the request now (its unfinished sequences with `status`, their pages back); its
        final output comes with the next step."""
        self._end_group(group, status)
        self._pending.append(self._close(group))

    def end_sequence(self, group: SequenceGroup, index: int, status: RequestStatus) -> None:
        """End one sequence now, its siblings going on; ending the last one ends the request,
        whose final output comes with the next step."""
        self._end_sequence(group.seqs[index], status)
        if group.finished:
            self._pending.append(self._close(group))

    def _fail(self, group: SequenceGroup, error: Exception) -> None:
        """End a request whose host-side processing raised: its pages go back, and its final
        output carries the error: the front ends answer that request alone, with its typed
        status (a constraint the tokenizer cannot follow is a 400) or else a 500."""
        group.error = error
        self.end_request(group, RequestStatus.FINISHED_ABORTED)

    def _end_group(self, group: SequenceGroup, status: RequestStatus) -> None:
        """End the request's unfinished sequences with `status`; their pages go back."""
        for seq in group.seqs:
            if seq.finish_reason is None:
                self._end_sequence(seq, status)

    def _stop(self, seq: SequenceState, reason: str, text: str) -> None:
        seq.text = text
        self._end_sequence(seq, RequestStatus.FINISHED_STOPPED if reason == "stop"
                           else RequestStatus.FINISHED_LENGTH)

    def _end_sequence(self, seq: SequenceState, status: RequestStatus) -> None:
        """The scheduler frees the sequence's pages; it is finished with status's reason."""
        self.scheduler.finish_request(seq.request.request_id, status)
        self._finish(seq, FINISH_REASON[status])

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.finish_reason = reason
        seq.matcher = None
        del self._by_seq[seq.request.request_id]

    # ---- outputs -----------------------------------------------------------------------------

    def _output(self, group: SequenceGroup) -> RequestOutput:
        """A snapshot: the consumer may be another thread while the engine goes on."""
        prepared = group.prepared
        outs = [CompletionOutput(s.index, s.text, _shown_tokens(s.request.output_token_ids),
                                 s.finish_reason, s.stop_reason,
                                 list(s.logprobs) if s.logprobs is not None else None)
                for s in group.seqs]
        return RequestOutput(prepared.request_id, prepared.prompt, prepared.prompt_token_ids, outs,
                             group.finished, group.seqs[0].request.num_cached_prompt_tokens,
                             group.metrics, group.error, group.prompt_logprobs,
                             group.seqs[0].request.num_cache_creation_tokens)

    def _close(self, group: SequenceGroup) -> RequestOutput:
        m = group.metrics
        m.finished_time = time.monotonic()
        m.num_draft_tokens = sum(s.request.num_draft_tokens for s in group.seqs)
        m.num_accepted_draft_tokens = sum(s.request.num_accepted_draft_tokens for s in group.seqs)
        del self.groups[group.prepared.request_id]
        self.num_finished += 1
        return self._output(group)


def _shown_tokens(token_ids: list[int]) -> list[int]:
    """A copy of the output tokens without the last one while it is a placeholder (a step
    launched before its tokens were read: jaxserve.core.scheduler)."""
    return token_ids[:-1] if token_ids and token_ids[-1] < 0 else list(token_ids)


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in text[start:] (the only part new tokens can complete one in)."""
    best = None
    for s in stops:
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best
