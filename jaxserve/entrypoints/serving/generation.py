"""`Generation`: one admitted API request, whatever its transport. It holds one engine request
per prompt, each with n choices, turns the engine's cumulative outputs into per-choice deltas
(through the tenant's output filter), and assembles them into OpenAI's chat or completion
response, or its stream of chunks. Every transport answers it inside `running()`, so however it
ends (done, client gone, deadline, error) its call ends once with its Outcome (calls.py: the
tenant's reservation settles, the version's lease ends, it is counted, logged and audited), and
its KV pages return at once.

The Outcome's tokens are those the engine computed (its `final` output of each engine request,
the same numbers its jaxserve:prompt_tokens and generation_tokens counters count): a prompt counts
once its first token was drawn (a request shed, timed out or left before that computed nothing
billable), and every token drawn counts, including those drawn after the client left or after
the output filter ended a choice, until the engine took the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

from jaxserve.core.serving_engine import ServingEngine
from jaxserve.fleet.versions import Lease
from jaxserve.gateway import Admission
from jaxserve.gateway.usage import with_cost
from jaxserve.entrypoints.serving import protocol
from jaxserve.entrypoints.serving import shadow
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.logprobs import (chat_logprobs, completion_logprobs,
                                                   echo_logprobs, join_completion_logprobs,
                                                   vllm_prompt_logprobs)
from jaxserve.entrypoints.serving.outcome import Outcome
from jaxserve.entrypoints.serving.screening import Screening
from jaxserve.entrypoints.serving.streams import merge_streams, with_keepalive
from jaxserve.entrypoints.serving.tool_output import ToolCallOutput
from jaxserve.telemetry.trace_record import request_attributes

# How long a request that ended early waits for the engine's last word on it (its tokens
# computed) before its call ends with the tokens it saw: an engine takes the abort before its
# next step; only a wedged one makes a request wait this long.
FINAL_OUTPUT_WAIT_S = 30.0
_ending: set[asyncio.Task] = set()  # the tasks ending requests (asyncio keeps weak references)


class Generation:
    """One admitted API request: its prepared engine requests (QoS stamped), its hold on the
    tenant's limits, its call, and what was sent so far. `metrics` (a ServerMetrics or None)
    observes its latencies as its tokens arrive; `max_queued` bounds its shadow copies as it
    bounded the request."""

    def __init__(self, gen_id: str, parsed: protocol.ParsedRequest, prepared: list,
                 admission: Admission, ctx: CallContext, lease: Lease, call: Call, *,
                 metrics=None, max_queued: int | None = None,
                 citations: list[dict] | None = None,
                 tool_output: ToolCallOutput | None = None,
                 screening: Screening | None = None, degraded: tuple[str, ...] = ()):
        self.call = call
        self.degraded = degraded  # why the route degraded it (degradation.py); (): it did not
        self.metrics = metrics
        self.max_queued = max_queued
        self.lease = lease  # the version chosen for this request (and its shadow copies)
        self.version = lease.version
        self.engine: ServingEngine = lease.version.engine
        self.route = lease.route or ""  # "": the version was addressed by name
        self.tool_output = tool_output or ToolCallOutput(None)
        self.screening = screening  # None: no policy, no audit
        self.citations = citations  # retrieval-augmented chat: what the prompt was given
        self.parsed = parsed
        self.chat = parsed.kind == "chat"
        self.prepared = prepared
        self.admission = admission
        self.ctx = ctx
        self.params = prepared[0].params
        self.id = gen_id  # the engine request ids are "{id}-{prompt index}"
        self.created = protocol.now()
        self.n = self.params.n
        self.num_choices = len(prepared) * self.n
        self.want_logprobs = parsed.logprobs is not None
        self.object = ("chat.completion" if self.chat else "text_completion")
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}
        self.stop_reasons: dict[int, int | str | None] = {}  # the stop string / token id
        self.cached_tokens: dict[int, int] = {}  # per prompt: tokens served by the prefix cache
        self.cache_creation_tokens: dict[int, int] = {}  # per prompt: written under a new pin
        self.completion_tokens: dict[int, int] = {}
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, when the engine scored it
        self.latest: dict[int, Any] = {}  # per prompt: the engine's latest output seen
        self.finals: dict[int, asyncio.Future] = {}  # per prompt started: its last output
        self.arrival = ctx.arrival
        self.first_token_at: float | None = None
        self.last_token_at: dict[int, float] = {}  # per choice: ITL is within one sequence
        self.engine_answered = False  # an output came back: the request left the queue
        self.error: BaseException | None = None  # what ended it, when reported in-band
        self.streamed = False  # its SSE stream started: its 200 went out
        self._itl = None  # its (version, route) and (version, route, tier) ITL histograms
        # Shadow copies compare their tokens with these (kept only when there are copies).
        self.token_ids: dict[int, list[int]] | None = {} if lease.shadows else None
        self._primary_tokens: asyncio.Future | None = None
        if ctx.trace is not None:
            ctx.trace.attributes.update(request_attributes(self.params))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def labels(self) -> tuple[str, str]:
        """The metrics' (model_name, route) of this request: its version and route."""
        return self.version.name, self.route

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [p.prompt_token_ids for p in self.prepared]

    @property
    def request_ids(self) -> list[str]:
        return [p.request_id for p in self.prepared]

    @property
    def tenant(self) -> str:
        return self.ctx.principal.tenant.name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    def stream_started(self) -> None:
        """Its SSE stream's 200 went out: a stream the stream-completion SLI expects to end."""
        self.streamed = True
        if self.metrics is not None:
            self.metrics.sli_streams_started.labels(*self.labels, self.tier).inc()

    @property
    def tier(self) -> str:
        return self.ctx.principal.tenant.priority.name.lower()

    def _itl_histograms(self) -> tuple:
        if self._itl is None:  # looked up once per request, not per token
            self._itl = (self.metrics.itl.labels(*self.labels),
                         self.metrics.sli_itl.labels(*self.labels, self.tier))
        return self._itl

    def usage(self) -> dict:
        """OpenAI's usage object, with "cost" (USD) when the model has prices."""
        return with_cost(protocol.usage(self.prompt_tokens, sum(self.completion_tokens.values()),
                                        sum(self.cached_tokens.values())),
                         self.version.pricing)

    def computed_usage(self) -> dict:
        """The usage object of what the engine computed (module doc): its last output of each
        engine request, else the latest one seen (the engine died, or never answered)."""
        prompt = completion = cached = 0
        for i, ids in enumerate(self.prompt_ids):
            final = self.finals.get(i)
            out = final.result() if final is not None and final.done() else None
            out = out or self.latest.get(i)
            if out is None:  # it never reached the engine
                continue
            if out.metrics is not None and out.metrics.first_token_time is not None:
                prompt += len(ids)
                cached += out.num_cached_tokens
            if not self.parsed.score_only:  # the one token drawn is not part of the answer
                completion += sum(len(c.token_ids) for c in out.outputs)
        return with_cost(protocol.usage(prompt, completion, cached), self.version.pricing)

    def streams(self) -> AsyncIterator[tuple[int, Any]]:
        return merge_streams([self._until_finished(i) for i in range(len(self.prepared))])

    async def _until_finished(self, index: int) -> AsyncIterator:
        """Prompt `index`'s engine stream, closed (so the engine request is aborted and its
        pages freed) once every choice of it has ended here: the policy ends a choice before
        the engine does. A choice it ends while its siblings go on (n > 1) has its engine
        sequence ended alone, so its pages return at once too."""
        final = self.finals[index] = asyncio.get_running_loop().create_future()
        stream = self.engine.generate(prepared=self.prepared[index], final=final)
        stopped: set[int] = set()
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out
                if all(index * self.n + j in self.finish_reasons for j in range(self.n)):
                    return
                for comp in out.outputs:
                    if comp.finish_reason is None and comp.index not in stopped \
                            and index * self.n + comp.index in self.finish_reasons:
                        stopped.add(comp.index)
                        await self.engine.abort_sequence(self.request_ids[index], comp.index)

    async def deltas(self) -> AsyncIterator[tuple[int, str, list[int], Any, str | None]]:
        """(choice, new text, new token ids, new logprobs, finish_reason) as the engine produces
        them, for transports that frame their own messages (gRPC)."""
        async for item in self.streams():
            for delta in self._deltas(*item):
                yield delta

    async def abort_unfinished(self) -> None:
        for i, rid in enumerate(self.request_ids):
            if any(i * self.n + j not in self.finish_reasons for j in range(self.n)):
                await self.engine.abort(rid)

    def _deltas(self, stream_index: int, out) -> list[tuple[int, str, list[int], Any, str | None]]:
        """(choice, new text, new token ids, new logprobs, finish_reason) since the last call."""
        result = []
        now = time.monotonic()
        self.engine_answered = True
        metrics = self.metrics
        if out.finished and metrics is not None and out.metrics is not None \
                and out.metrics.first_scheduled_time is not None:
            metrics.queue.labels(*self.labels, self.tenant).observe(
                out.metrics.first_scheduled_time - out.metrics.arrival_time)
        if out.finished and self.ctx.trace is not None:
            self.ctx.trace.engine_done(stream_index, out.metrics,
                                       sum(len(c.token_ids) for c in out.outputs))
        self.latest[stream_index] = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[stream_index] = out.prompt_logprobs
        self.cached_tokens[stream_index] = out.num_cached_tokens
        self.cache_creation_tokens[stream_index] = out.num_cache_creation_tokens
        for comp in out.outputs:
            choice = stream_index * self.n + comp.index
            if choice in self.finish_reasons:  # ended (by the engine or by the policy)
                continue
            t0, k0 = self.sent_text.get(choice, 0), self.sent_tokens.get(choice, 0)
            text, ids = comp.text[t0:], list(comp.token_ids[k0:])
            if self.parsed.score_only:  # the one token drawn is not part of the answer
                text, ids = "", []
            if ids and metrics is not None:
                if self.first_token_at is None:
                    metrics.ttft.labels(*self.labels, self.tenant).observe(
                        now - self.arrival)
                elif choice in self.last_token_at:
                    # Tokens that arrive together (a delta of several) share the gap evenly.
                    gap = (now - self.last_token_at[choice]) / len(ids)
                    for _ in ids:
                        for histogram in self._itl_histograms():
                            histogram.observe(gap)
            if ids and self.token_ids is not None:
                self.token_ids.setdefault(choice, []).extend(ids)
            if ids:
                self.first_token_at = self.first_token_at or now
                self.last_token_at[choice] = now
            logprobs = comp.logprobs[k0:] if comp.logprobs is not None else None
            self.sent_text[choice], self.sent_tokens[choice] = len(comp.text), len(comp.token_ids)
            self.completion_tokens[choice] = len(comp.token_ids)
            finish = None
            if comp.finish_reason is not None:
                finish = self.finish_reasons[choice] = comp.finish_reason
                self.stop_reasons[choice] = comp.stop_reason
            if self.parsed.score_only:
                logprobs = [] if logprobs is not None else None
                self.completion_tokens[choice] = 0
                if finish is not None and finish in ("stop", "length"):
                    finish = self.finish_reasons[choice] = "length"
            if self.screening is not None:
                text, ids, logprobs, blocked = self.screening.output(
                    choice, comp.text, text, ids, logprobs, comp.finish_reason is not None,
                    lag=max(map(len, self.params.stop), default=1) - 1)
                if blocked:  # OpenAI's value; _until_finished stops the engine request
                    finish = self.finish_reasons[choice] = "content_filter"
            if text or ids or finish:
                result.append((choice, text, ids, logprobs, finish))
        return result

    def echo_prefix(self, choice: int) -> str:
        if not self.parsed.echo:
            return ""
        return self.tokenizer.decode(self.prompt_ids[choice // self.n])

    def prompt_logprobs_of(self, choice: int) -> list:
        """The engine's prompt logprobs of the choice's prompt (all None if it never scored:
        the request ended first)."""
        prompt = choice // self.n
        return self.prompt_logprobs.get(prompt) or [None] * len(self.prompt_ids[prompt])

    def _echo_logprobs(self, choice: int) -> dict:
        return echo_logprobs(self.tokenizer, self.prompt_logprobs_of(choice),
                             self.prompt_ids[choice // self.n], self.parsed.logprobs)

    async def response(self) -> dict:
        """Run to completion and build the non-streaming response body."""
        tok = self.tokenizer
        texts = {i: "" for i in range(self.num_choices)}
        ids = {i: [] for i in range(self.num_choices)}
        lps = {i: [] for i in range(self.num_choices)}
        async for s, out in self.streams():
            for choice, text, new_ids, new_lps, _ in self._deltas(s, out):
                texts[choice] += text
                ids[choice] += new_ids
                lps[choice] += list(new_lps or ())
        choices = []
        for i in range(self.num_choices):
            if self.chat:
                message, finish = self.tool_output.message(texts[i], self.finish_reasons.get(i))
                choices.append({"index": i, "message": message,
                                "logprobs": chat_logprobs(tok, ids[i], lps[i]) if self.want_logprobs
                                else None,
                                "finish_reason": finish})
            else:
                prefix = self.echo_prefix(i)
                logprobs = None
                if self.want_logprobs:
                    logprobs = completion_logprobs(tok, ids[i], lps[i], len(prefix))
                    if self.parsed.echo:
                        logprobs = join_completion_logprobs(self._echo_logprobs(i), logprobs)
                choices.append({"index": i, "text": prefix + texts[i], "logprobs": logprobs,
                                "finish_reason": self.finish_reasons.get(i)})
                if self.parsed.prompt_logprobs is not None:  # vLLM's: per choice
                    choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(
                        tok, self.prompt_logprobs_of(i), self.parsed.prompt_logprobs)
        body = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.version.name, "system_fingerprint": self.version.fingerprint,
                "choices": choices, "usage": self.usage()}
        if self.chat and self.parsed.prompt_logprobs is not None:  # vLLM's: one prompt
            body["prompt_logprobs"] = vllm_prompt_logprobs(tok, self.prompt_logprobs_of(0),
                                                           self.parsed.prompt_logprobs)
        if self.citations is not None:
            body["citations"] = self.citations
        return body

    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        chunk = {"id": self.id,
                 "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.version.name,
                 "system_fingerprint": self.version.fingerprint, "choices": choices}
        if self.parsed.include_usage:
            # OpenAI: null on every chunk but the last; vLLM's continuous_usage_stats: so far.
            chunk["usage"] = usage if usage or not self.parsed.continuous_usage else self.usage()
        return chunk

    async def chunks(self, keepalive_seconds: float) -> AsyncIterator[dict | None]:
        """Streaming chunks in OpenAI's shape; None where a keep-alive should go out."""
        tok = self.tokenizer
        offsets: dict[int, int] = {}
        echo_pending: set[int] = set()  # echo with logprobs: prompt not sent yet
        if self.chat:  # OpenAI opens each choice with the assistant role
            first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
                                 for i in range(self.num_choices)])
            if self.citations is not None:  # known before the first token: sent up front
                first["citations"] = self.citations
            yield first
        elif self.parsed.echo:
            for i in range(self.num_choices):
                prefix = self.echo_prefix(i)
                offsets[i] = len(prefix)
                if self.want_logprobs:  # its logprobs come with the engine's first output
                    echo_pending.add(i)
                else:
                    yield self._chunk([{"index": i, "text": prefix, "logprobs": None,
                                        "finish_reason": None}])
        async for item in with_keepalive(self.streams(), keepalive_seconds):
            if item is None:
                yield None
                continue
            for choice, text, ids, lps, finish in self._deltas(*item):
                if choice in echo_pending:
                    echo_pending.discard(choice)
                    yield self._chunk([{"index": choice, "text": self.echo_prefix(choice),
                                        "logprobs": self._echo_logprobs(choice),
                                        "finish_reason": None}])
                if self.chat:
                    delta, finish = self.tool_output.delta(choice, text, finish)
                    if not delta and finish is None and not self.want_logprobs:
                        continue  # held back by the tool-call parser: nothing to say yet
                    c = {"index": choice, "delta": delta,
                         "logprobs": chat_logprobs(tok, ids, lps) if self.want_logprobs else None,
                         "finish_reason": finish}
                else:
                    off = offsets.get(choice, 0)
                    c = {"index": choice, "text": text,
                         "logprobs": completion_logprobs(tok, ids, lps, off) if self.want_logprobs
                         else None,
                         "finish_reason": finish}
                    offsets[choice] = off + len(text)
                yield self._chunk([c])
        if self.parsed.include_usage:
            yield self._chunk([], self.usage())

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["Generation"]:
        """What every transport answers the request in: at its end, however it ends, its call
        ends (with the exception that left the block, or `self.error` for one the transport
        reported in-band, such as a stream's error event) and the engine aborts what is
        unfinished, so its pages return at once."""
        error = None
        self._start_shadows()
        try:
            yield self
        except BaseException as exc:
            error = exc
            raise
        finally:
            # In a task of its own: a client that closes right after [DONE] cancels the handler
            # here, and the task still ends the call (which the transport then leaves alone).
            self.call.ending = True
            ending = asyncio.ensure_future(self._finish(self.error or error))
            _ending.add(ending)
            ending.add_done_callback(_ending.discard)
            await asyncio.shield(ending)

    async def _finish(self, error: BaseException | None) -> None:
        """Abort what is unfinished (its pages return at once), wait for the engine's last
        output of each engine request (the tokens computed: `computed_usage`), end the call."""
        try:
            await self.abort_unfinished()
            pending = [f for f in self.finals.values() if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=FINAL_OUTPUT_WAIT_S)
        finally:
            self._end(error)

    def _start_shadows(self) -> None:
        if not self.lease.shadows:
            return
        self._primary_tokens = asyncio.get_running_loop().create_future()
        for lease in self.lease.shadows:
            shadow.start(lease, self.parsed, self.params, self._primary_tokens, self.max_queued,
                         self.id, self.ctx.trace)

    def _end(self, error: BaseException | None) -> None:
        """The request ended (error None: answered in full): its shadow copies get the tokens
        to compare with, and its call its Outcome."""
        if self._primary_tokens is not None and not self._primary_tokens.done():
            self._primary_tokens.set_result(
                None if error is not None else
                [self.token_ids.get(i * self.n, []) for i in range(len(self.prepared))])
        self.call.end(self._outcome(error), tenant_hold=self.admission, version_lease=self.lease)

    def _outcome(self, error: BaseException | None) -> Outcome:
        usage = self.computed_usage()
        return Outcome(
            self.id, self.ctx, error, kind=self.parsed.kind, model=self.parsed.model,
            version=self.version.name, route=self.route, served=True,
            prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
            cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            cost=usage.get("cost"),
            finish_reasons=tuple(self.finish_reasons.get(i, "") for i in range(self.num_choices)),
            first_token_at=self.first_token_at, screening=self.screening,
            prompts=self.parsed.prompts, streamed=self.streamed, degraded=self.degraded)
