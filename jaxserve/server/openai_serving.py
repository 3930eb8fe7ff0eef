"""OpenAI chat/text completions over an AsyncEngine, with no transport: HTTP (server/http.py), gRPC
and the offline batch runner all call this, so a response body is built in exactly one place.

A request is parsed and tokenized once here and admitted on one path (admission.py). A
`Generation` is one admitted API request: one engine request per prompt, each with n choices. It
turns the engine's cumulative outputs into per-choice deltas; every transport answers it inside
`running()`, so however it ends (done, client gone, deadline, error) its tenant's reservation
settles, it is counted and logged once, and its KV pages return at once.

A chat with tools gets them in its prompt and its output parsed into `tool_calls`
(server/tool_output.py); a forced tool_choice becomes a grammar constraint. Every request
is prepared for the engine up front (its grammar compiled, a 400 before any stream starts), a
constrained one in an executor so a slow compile never blocks the event loop.

Every request's model version is chosen through the fleet (`fleet.select`: a route's weights,
stickiness and shadow copies, or a version named directly); the version's engine, tokenizer,
price and generation defaults serve it, its answers carry the version's name and
`system_fingerprint`, and its end is recorded on the version's lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator

from jaxserve.config import RequestLimits
from jaxserve.errors import (ContextLengthExceeded, EngineDead, EngineOverloaded, InvalidRequest,
                             outcome, version_fault)
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.versions import Lease
from jaxserve.gateway import Admission, Gateway
from jaxserve.gateway.usage import with_cost
from jaxserve.pricing import Pricing
from jaxserve.server import protocol, shadow
from jaxserve.server.admission import CallContext, admit, tenant_params
from jaxserve.server.generation_defaults import with_defaults
from jaxserve.server.tool_output import ToolCallOutput
from jaxserve.tools.choice import forced_tool_call
from jaxserve.tools.parsers import get_tool_parser

access_log = logging.getLogger("jaxserve.access")


async def with_keepalive(agen: AsyncIterator, interval: float) -> AsyncIterator:
    """Yield the generator's items, and None whenever `interval` passes without one."""
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(agen.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as (stream index, output) in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


# A token the grammar masked has logprob -inf, which JSON cannot carry: clamped, as vLLM does.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(tokenizer, ids: list[int], logprobs) -> dict:
    content = []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tops = []
        for i, v in lp.top:
            t = _token_str(tokenizer, i)
            tops.append({"token": t, "logprob": _logprob(v), "bytes": list(t.encode("utf-8"))})
        content.append({"token": tok, "logprob": _logprob(lp.logprob),
                        "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], logprobs, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, logprobs):
        tok = _token_str(tokenizer, tid)
        tokens.append(tok)
        token_lps.append(_logprob(lp.logprob))
        tops.append({_token_str(tokenizer, i): _logprob(v) for i, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


class Generation:
    """One admitted API request: its prepared engine requests (QoS stamped), its hold on the
    tenant's limits, and what was sent so far."""

    def __init__(self, serving: "OpenAIServing", gen_id: str, parsed: protocol.ParsedRequest,
                 prepared: list, admission: Admission, ctx: CallContext, lease: Lease,
                 citations: list[dict] | None = None,
                 tool_output: ToolCallOutput | None = None, screening=None):
        self.serving = serving
        self.lease = lease  # the version chosen for this request (and its shadow copies)
        self.version = lease.version
        self.engine = lease.version.engine
        self.route = lease.route or ""  # "": the version was addressed by name
        self.tool_output = tool_output or ToolCallOutput(None)
        self.screening = screening  # request_policy.Screening, or None: no policy, no audit
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
        self.completion_tokens: dict[int, int] = {}
        self.arrival = ctx.arrival
        self.first_token_at: float | None = None
        self.last_token_at: dict[int, float] = {}  # per choice: ITL is within one sequence
        self.engine_answered = False  # an output came back: the request left the queue
        self.error: BaseException | None = None  # what ended it, when reported in-band
        self._finished = False
        # Shadow copies compare their tokens with these (kept only when there are copies).
        self.token_ids: dict[int, list[int]] | None = {} if lease.shadows else None
        self._primary_tokens: asyncio.Future | None = None

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

    def usage(self) -> dict:
        """OpenAI's usage object, with "cost" (USD) when the model has prices."""
        return with_cost(protocol.usage(self.prompt_tokens, sum(self.completion_tokens.values())),
                         self.version.pricing)

    def streams(self) -> AsyncIterator[tuple[int, Any]]:
        return merge_streams([self._until_finished(i, self.engine.generate(prepared=p))
                              for i, p in enumerate(self.prepared)])

    async def _until_finished(self, index: int, stream: AsyncIterator) -> AsyncIterator:
        """Prompt `index`'s engine stream, closed (so the engine request is aborted and its
        pages freed) once every choice of it has ended here: the policy ends a choice before
        the engine does. A choice it ends while its siblings go on (n > 1) has its engine
        sequence ended alone, so its pages return at once too."""
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
        metrics = self.serving.metrics
        if out.finished and metrics is not None and out.metrics is not None \
                and out.metrics.first_scheduled_time is not None:
            metrics.queue.labels(*self.labels, self.tenant).observe(
                out.metrics.first_scheduled_time - out.metrics.arrival_time)
        for comp in out.outputs:
            choice = stream_index * self.n + comp.index
            if choice in self.finish_reasons:  # ended (by the engine or by the policy)
                continue
            t0, k0 = self.sent_text.get(choice, 0), self.sent_tokens.get(choice, 0)
            text, ids = comp.text[t0:], list(comp.token_ids[k0:])
            if ids and metrics is not None:
                if self.first_token_at is None:
                    metrics.ttft.labels(*self.labels, self.tenant).observe(
                        now - self.arrival)
                elif choice in self.last_token_at:
                    # Tokens that arrive together (a delta of several) share the gap evenly.
                    gap = (now - self.last_token_at[choice]) / len(ids)
                    for _ in ids:
                        metrics.itl.labels(*self.labels).observe(gap)
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
            if self.screening is not None:
                text, ids, logprobs, blocked = self.screening.output(
                    choice, comp.text, text, ids, logprobs, comp.finish_reason is not None)
                if blocked:  # OpenAI's value; _until_finished stops the engine request
                    finish = self.finish_reasons[choice] = "content_filter"
            if text or ids or finish:
                result.append((choice, text, ids, logprobs, finish))
        return result

    def _echo_prefix(self, choice: int) -> str:
        if not self.parsed.echo:
            return ""
        return self.tokenizer.decode(self.prompt_ids[choice // self.n])

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
                prefix = self._echo_prefix(i)
                choices.append({"index": i, "text": prefix + texts[i],
                                "logprobs": completion_logprobs(tok, ids[i], lps[i], len(prefix))
                                if self.want_logprobs else None,
                                "finish_reason": self.finish_reasons.get(i)})
        body = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.version.name, "system_fingerprint": self.version.fingerprint,
                "choices": choices, "usage": self.usage()}
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
        if self.chat:  # OpenAI opens each choice with the assistant role
            first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
                                 for i in range(self.num_choices)])
            if self.citations is not None:  # known before the first token: sent up front
                first["citations"] = self.citations
            yield first
        elif self.parsed.echo:
            for i in range(self.num_choices):
                prefix = self._echo_prefix(i)
                offsets[i] = len(prefix)
                yield self._chunk([{"index": i, "text": prefix, "logprobs": None,
                                    "finish_reason": None}])
        async for item in with_keepalive(self.streams(), keepalive_seconds):
            if item is None:
                yield None
                continue
            for choice, text, ids, lps, finish in self._deltas(*item):
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
        """What every transport answers the request in: at its end, however it ends, `finish`
        (with the exception that left the block, or `self.error` for one the transport reported
        in-band, such as a stream's error event) and the engine aborts what is unfinished, so
        its pages return at once."""
        error = None
        self._start_shadows()
        try:
            yield self
        except BaseException as exc:
            error = exc
            raise
        finally:
            # Counted and logged first: a client that closes right after [DONE] cancels the
            # handler here, and the await below would then raise before anything after it ran.
            self.finish(self.error or error)
            await asyncio.shield(self.abort_unfinished())

    def _start_shadows(self) -> None:
        if not self.lease.shadows:
            return
        self._primary_tokens = asyncio.get_running_loop().create_future()
        for lease in self.lease.shadows:
            shadow.start(lease, self.parsed, self.params, self.serving.prompt_ids,
                         self._primary_tokens, self.serving.max_queued_requests, self.id)

    def finish(self, error: BaseException | None) -> None:
        """The request ended (error None: answered in full): settle the tenant's reservation with
        the tokens used, count it per tenant, write its access-log line. Once; later calls do
        nothing."""
        if self._finished:
            return
        self._finished = True
        end = time.monotonic()
        completion = sum(self.completion_tokens.values())
        self.admission.settle(self.prompt_tokens + completion)
        status = outcome(error)
        usage = self.usage()
        metrics = self.serving.metrics
        if metrics is not None:
            metrics.e2e.labels(*self.labels).observe(end - self.arrival)
            metrics.record_request(self.tenant, status, self.prompt_tokens, completion,
                                   usage.get("cost", 0.0), *self.labels)
        ttft = None if self.first_token_at is None else round(self.first_token_at - self.arrival, 4)
        self.lease.finish(error=version_fault(error), ttft=ttft, prompt_tokens=self.prompt_tokens,
                          completion_tokens=completion)
        if self._primary_tokens is not None and not self._primary_tokens.done():
            self._primary_tokens.set_result(
                None if error is not None else
                [self.token_ids.get(i * self.n, []) for i in range(len(self.prepared))])
        record = {
            "request_id": self.id, "model": self.version.name, "route": self.route,
            "kind": self.parsed.kind,
            "transport": self.ctx.transport, "tenant": self.tenant,
            "key_id": self.ctx.principal.key_id, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion, "ttft_s": ttft,
            "total_s": round(end - self.arrival, 4),
            "finish_reasons": sorted(set(self.finish_reasons.values())), "status": status}
        if self.serving.log_prompts:  # off by default: prompts may hold what users keep private
            record["prompt"] = (self.parsed.prompts if self.screening is None else
                                [self.screening.redact_pii(t)
                                 for t in self.screening.prompt_texts])
        access_log.info(json.dumps(record))
        if self.serving.policy is not None:
            self.serving.policy.record(
                request_id=self.id, kind=self.parsed.kind, ctx=self.ctx, error=error,
                model=self.parsed.model, version=self.version.name,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=completion, cost=usage.get("cost"),
                finish_reasons=[self.finish_reasons.get(i, "") for i in range(self.num_choices)],
                screening=self.screening)


class OpenAIServing:
    """Parses and checks OpenAI generation requests once, chooses their version through the fleet
    and admits them (admission.py) on its engine, for every transport.

    `fleet`: the model versions and routes (serve --deployment). Without one, `engine` alone is
    served as a fleet of one version named `model_name`, priced `pricing`."""

    def __init__(self, engine, model_name: str, metrics=None, log_prompts: bool = False,
                 rag=None, max_queued_requests: int | None = None,
                 limits: RequestLimits = RequestLimits(), tool_call_parser: str = "hermes",
                 gateway: Gateway | None = None, pricing: Pricing | None = None,
                 fleet: Fleet | None = None, policy=None):
        if fleet is None:
            fleet = (Fleet.of_engine(model_name, engine, pricing=pricing) if engine is not None
                     else Fleet.empty())
        self.fleet = fleet
        self.engine = engine  # the one engine of a --model server; None with a deployment
        # ConfigError at start for an unknown name; "hermes" matches the built-in tool prompt.
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.policy = policy  # a request_policy.RequestPolicy, or None: no policy, no audit
        self.model_name = model_name
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.rag = rag  # a jaxserve.rag.service.RagService, or None: no retrieval
        self.max_queued_requests = max_queued_requests  # None: no admission limit
        self.limits = limits
        self.gateway = gateway if gateway is not None else Gateway()

    def open_context(self, transport: str) -> CallContext:
        """The context of a caller with no credentials: the open server's `default` tenant."""
        return CallContext(self.gateway.authenticate(None), transport=transport)

    def engine_for(self, model: str):
        """The engine a request naming `model` would run on (for tokenize / detokenize): raises
        ModelNotFound for a name that is neither a route nor a ready version."""
        with self.fleet.select(model) as lease:
            return lease.version.engine

    @staticmethod
    def check_token_ids(tokenizer, ids: list[int], param: str) -> None:
        vocab = tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                 param=param)

    async def prepare_async(self, kind: str, body: Any, ctx: CallContext) -> Generation:
        """Everything that can fail before generation starts: a failure here is the client's
        4xx (or 503 when the engine cannot take it), takes nothing from its tenant, and is
        audited. The tenant's input rules run first (a classifier in its executor). A chat
        with "rag" has its collection searched for the last user message (in an executor:
        embedding and search block) and the results put into the prompt; the response then
        carries "citations".

        A request that fails here (or whose caller leaves meanwhile) gets its one audit
        record here, naming the version chosen if it got that far; an admitted one gets it
        from its Generation when it ends."""
        parsed = lease = None
        try:
            parsed = self._parse(kind, body, ctx)
            lease = self.fleet.select(parsed.model, user=parsed.user,
                                      api_key=ctx.principal.key_id)
            return await self._prepare(kind, body, parsed, ctx, lease)
        except BaseException as e:
            if lease is not None:
                lease.__exit__(None, None, None)  # releases it and its shadow copies
            if self.policy is not None:
                self.policy.record(request_id=protocol.new_id("req"), kind=kind, ctx=ctx,
                                   error=e, model=parsed.model if parsed is not None else None,
                                   version=lease.version.name if lease is not None else None)
            raise

    async def _prepare(self, kind: str, body: Any, parsed: protocol.ParsedRequest,
                       ctx: CallContext, lease: Lease) -> Generation:
        defaults = lease.version.generation_defaults
        if defaults:  # parsed again: the defaults go through the same checks as the body
            parsed = self._parse_body(kind, with_defaults(body, kind, defaults))
        screening = None
        if self.policy is not None:
            parsed, screening = await self.policy.screen(parsed, ctx.principal.tenant,
                                                         lease.version.engine.tokenizer.decode)
        citations = None
        if parsed.rag is not None:
            if self.rag is None:
                raise InvalidRequest("this server has no retrieval ('rag'): it was started with "
                                     "--no-rag", param="rag")
            from jaxserve.rag.prompt import augment_chat, parse_rag_request

            rag = parse_rag_request(parsed.rag, self.rag.config.search.max_top_k)
            messages, citations = await asyncio.get_running_loop().run_in_executor(
                None, augment_chat, self.rag, parsed.prompts[0], rag, ctx.principal.tenant.name,
                screening.screen_chunks if screening is not None else None)
            parsed = dataclasses.replace(parsed, prompts=[messages])
        parsed, tool_output = self._tools(parsed)
        if parsed.sampling_params.structured_outputs is not None:  # its grammar compiles
            return await asyncio.get_running_loop().run_in_executor(
                None, self._start, parsed, ctx, lease, citations, tool_output, screening)
        return self._start(parsed, ctx, lease, citations, tool_output, screening)

    def _parse_body(self, kind: str, body: Any) -> protocol.ParsedRequest:
        parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
        return parse(body, self.limits)

    def _parse(self, kind: str, body: Any, ctx: CallContext) -> protocol.ParsedRequest:
        parsed = self._parse_body(kind, body)
        # The edge check, before the prompt is tokenized: a tenant out of requests costs little,
        # and one that may not use the model learns nothing about what this server serves.
        self.gateway.check(ctx.principal, parsed.model)
        return parsed

    def _start(self, parsed: protocol.ParsedRequest, ctx: CallContext, lease: Lease,
               citations: list[dict] | None, tool_output: ToolCallOutput,
               screening=None) -> Generation:
        engine = lease.version.engine
        prompt_ids = [self.prompt_ids(engine.tokenizer, parsed, p) for p in parsed.prompts]
        params = self._fit_context(engine, parsed, prompt_ids)
        if not engine.is_running:
            raise EngineDead("the engine is not running; the server cannot generate")
        if engine.is_stalled:  # a request now would only wait for nothing
            raise EngineOverloaded("the engine has made no progress for a while (see GET "
                                   "/ready); retry later")
        # The whole request against the KV pool, before a stream's headers go out, so it is still
        # a 400 and not an error inside a 200 stream.
        params = engine.fit_kv_pool([len(p) for p in prompt_ids], params)
        params = tenant_params(ctx.principal, params, parsed.max_tokens_given)
        gen_id = protocol.new_id("chatcmpl" if parsed.kind == "chat" else "cmpl")
        admission, prepared = admit(engine, self.gateway, ctx,
                                    [f"{gen_id}-{i}" for i in range(len(prompt_ids))],
                                    prompt_ids, params, self.max_queued_requests)
        return Generation(self, gen_id, parsed, prepared, admission, ctx, lease, citations,
                          tool_output, screening)

    def _tools(self, parsed: protocol.ParsedRequest
               ) -> tuple[protocol.ParsedRequest, ToolCallOutput]:
        """tool_choice "none" (or no tools): the tools stay out of the prompt and the output is
        content. "auto": the model may call, its text is parsed. "required" / named: a grammar
        constraint makes it call (protocol refused it beside another constraint)."""
        if parsed.tool_choice.mode == "none":
            return dataclasses.replace(parsed, tools=()), ToolCallOutput(None)
        changes = {}
        forced = forced_tool_call(parsed.tools, parsed.tool_choice, self.tool_parser,
                                  parallel_tool_calls=parsed.parallel_tool_calls)
        if forced is not None:
            changes["structured_outputs"] = forced
        if self.tool_parser.needs_special_tokens:  # as vLLM's mistral parser does
            changes["skip_special_tokens"] = False
        if changes:
            parsed = dataclasses.replace(
                parsed, sampling_params=parsed.sampling_params.replace(**changes))
        return parsed, ToolCallOutput(self.tool_parser)

    @staticmethod
    def prompt_ids(tokenizer, parsed: protocol.ParsedRequest, prompt) -> list[int]:
        """Tokenized once, here, by the version's tokenizer; the engine's `prepare` checks the
        ids (empty, vocabulary, context)."""
        if parsed.kind == "chat":
            return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                      tools=parsed.tools))
        return list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    @staticmethod
    def _fit_context(engine, parsed: protocol.ParsedRequest, prompt_ids: list[list[int]]):
        """OpenAI's rule: prompt + max_tokens within the context (the engine alone would cut the
        completion at the context instead). A chat request without max_tokens keeps None: the
        engine gives it the rest of the context, or what the KV pool can hold."""
        max_len = engine.max_model_len
        longest = max(len(p) for p in prompt_ids)
        params = parsed.sampling_params
        what = "messages" if parsed.kind == "chat" else "prompt"
        if not parsed.max_tokens_given:
            if longest >= max_len:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {max_len} tokens. However, your "
                    f"{what} resulted in {longest} tokens.", param=what)
            return params
        if longest + params.max_tokens > max_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{longest + params.max_tokens} tokens ({longest} in the {what}, "
                f"{params.max_tokens} in the completion). Please reduce the length of the {what} "
                "or completion.",
                param="max_tokens")
        return params
