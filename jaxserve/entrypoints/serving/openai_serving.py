"""OpenAI chat/text completions over an AsyncEngine, with no transport: HTTP
(entrypoints/http/app.py), gRPC and the offline batch runner all call this, so a response body is
built in exactly one place.

A request is parsed and tokenized once here and admitted on one path (admission.py); what it
becomes is a `Generation` (generation.py): its engine requests, deltas, response or chunks,
and its one end. A request refused here ends its call here (calls.py).

A chat with tools gets them in its prompt and its output parsed into `tool_calls`, and a thinking
model's reasoning into `reasoning_content` (entrypoints/serving/tool_output.py, parsers chosen per
model by its chat template or the flags); a forced tool_choice becomes a grammar constraint. Every
request is prepared for the engine up front (its grammar compiled, a 400 before any stream starts),
in an executor so a long prompt or a slow compile never blocks the event loop; its admission is
taken on the loop after that.

Every request's model version is chosen through the fleet (`fleet.select`: a route's weights,
stickiness and shadow copies, or a version named directly); the version's engine, tokenizer,
price and generation defaults serve it, its answers carry the version's name and
`system_fingerprint`, and its end is recorded on the version's lease. Under overload a route may
degrade the request's class (degradation.py): another version answers, or its completion is
capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Sequence

from jaxserve.config import RequestLimits
from jaxserve.core.serving_engine import ServingEngine
from jaxserve.errors import (ContextLengthExceeded, EngineDead, EngineOverloaded, InvalidRequest,
                             error_status)
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.versions import Lease
from jaxserve.gateway import Gateway
from jaxserve.gateway.pricing import Pricing
from jaxserve.entrypoints.serving import protocol
from jaxserve.entrypoints.serving.admission import (CallContext, admit, prepare_requests,
                                                    tenant_params)
from jaxserve.entrypoints.serving.cache_pins import Breakpoint, pin_positions
from jaxserve.entrypoints.serving.calls import Call, Sinks
from jaxserve.entrypoints.serving.degradation import degrade
from jaxserve.entrypoints.serving.generation import Generation
from jaxserve.entrypoints.serving.generation_defaults import with_defaults
from jaxserve.entrypoints.serving.outcome import Outcome
from jaxserve.entrypoints.serving.response_caching import CacheUse, replayed
from jaxserve.gateway.response_cache import CachedAnswer
from jaxserve.entrypoints.serving.tool_output import ParserChoice, ToolCallOutput
from jaxserve.structured.params import REASONING_KINDS
from jaxserve.telemetry.trace_record import timed
from jaxserve.tool_calling.choice import forced_tool_call


class OpenAIServing:
    """Parses and checks OpenAI generation requests once, chooses their version through the fleet
    and admits them (admission.py) on its engine, for every transport.

    `fleet`: the model versions and routes (serve --deployment). Without one, `engine` alone is
    served as a fleet of one version named `model_name`, priced `pricing`. `sinks`: where its
    calls' outcomes go (the HTTP app's, shared with its front door); default: `metrics`, the
    access log and `policy`'s audit log."""

    def __init__(self, engine: ServingEngine | None, model_name: str, metrics=None, rag=None,
                 max_queued_requests: int | None = None,
                 limits: RequestLimits = RequestLimits(), tool_call_parser: str = "auto",
                 gateway: Gateway | None = None, pricing: Pricing | None = None,
                 fleet: Fleet | None = None, policy=None, sinks: Sinks | None = None,
                 reasoning_parser: str = "auto", tracing=None):
        if fleet is None:
            fleet = (Fleet.of_engine(model_name, engine, pricing=pricing,
                                     max_queued_requests=max_queued_requests)
                     if engine is not None else Fleet.empty())
        self.fleet = fleet
        self.engine = engine  # the one engine of a --model server; None with a deployment
        # ConfigError at start for an unknown name; "auto": each version's chat template decides.
        self.parsers = ParserChoice(tool_call_parser, reasoning_parser)
        self.policy = policy  # a request_policy.RequestPolicy, or None: no policy, no audit
        self.model_name = model_name
        self.metrics = metrics
        self.sinks = sinks if sinks is not None else Sinks(metrics, policy)
        self.rag = rag  # a jaxserve.rag.service.RagService, or None: no retrieval
        self.max_queued_requests = max_queued_requests  # None: no admission limit
        self.limits = limits
        self.gateway = gateway if gateway is not None else Gateway()
        self.tracing = tracing  # a telemetry.tracing.Tracing (its sink is in `sinks`), or None

    def open_context(self, transport: str) -> CallContext:
        """The context of a caller with no credentials: the open server's `default` tenant."""
        return CallContext(self.gateway.authenticate(None), transport=transport)

    def engine_for(self, model: str) -> ServingEngine:
        """The engine a request naming `model` would run on (for tokenize / detokenize): raises
        ModelNotFound for a name that is neither a route nor a ready version."""
        with self.fleet.select(model) as lease:
            return lease.version.engine

    def count_prompt_tokens(self, body: Any, ctx: CallContext) -> int:
        """The prompt tokens a chat `body` would send its model (template and tools as a
        generation renders them), generating nothing: Anthropic's count_tokens. On any thread."""
        parsed = self._parse_body("chat", body)
        ctx.principal.tenant.check_model(parsed.model)
        tokenizer = self.engine_for(parsed.model).tokenizer
        parsed, _ = self._tools(parsed, tokenizer)
        return len(protocol.prompt_ids(tokenizer, parsed, parsed.prompts[0]))

    @staticmethod
    def check_token_ids(tokenizer, ids: list[int], param: str) -> None:
        vocab = tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                 param=param)

    async def prepare_async(self, kind: str, body: Any, ctx: CallContext,
                            call: Call, pins: Sequence[Breakpoint] = (),
                            cache: CacheUse | None = None) -> Generation | CachedAnswer:
        """Everything that can fail before generation starts: a failure here is the client's
        4xx (or 503 when the engine cannot take it), costs its tenant one request of its rate
        when it is a 4xx (nothing else is taken), and ends `call` here, naming the version
        chosen if it got that far. The tenant's input rules
        run first (a classifier in its executor). A chat with "rag" has its collection
        searched for the last user message (in an executor: embedding and search block) and
        the results put into the prompt; the response then carries "citations". An admitted
        request's call ends with its Generation. `pins`: prompt-cache breakpoints to pin
        (cache_pins.py). `cache`: the request's use of the response cache (HTTP chat and
        completions): a hit is answered here, returned as the CachedAnswer to send, its call
        ended."""
        parsed = lease = None
        try:
            parsed = self._parse(kind, body, ctx)
            lease = self.fleet.select(parsed.model, user=parsed.user,
                                      api_key=ctx.principal.key_id,
                                      priority=ctx.principal.tenant.priority)
            return await self._prepare(kind, body, parsed, ctx, lease, call, pins, cache)
        except BaseException as e:  # refused, or its caller left meanwhile
            if ctx.principal is not None and 400 <= error_status(e).http < 500:
                self.gateway.refused(ctx.principal)  # the client's fault costs a request
            call.end(Outcome(protocol.new_id("req"), ctx, e, kind=kind,
                             model=parsed.model if parsed is not None else None,
                             version=lease.version.name if lease is not None else None),
                     version_lease=lease)
            raise

    async def _prepare(self, kind: str, body: Any, parsed: protocol.ParsedRequest,
                       ctx: CallContext, lease: Lease, call: Call,
                       pins: Sequence[Breakpoint] = (), cache: CacheUse | None = None
                       ) -> Generation | CachedAnswer:
        defaults = lease.version.generation_defaults
        if defaults:  # parsed again: the defaults go through the same checks as the body
            parsed = self._parse_body(kind, with_defaults(body, kind, defaults))
        screening = None
        if self.policy is not None:
            with timed(ctx.trace, "policy_screening"):
                parsed, screening = await self.policy.screen(
                    parsed, ctx.principal.tenant, lease.version.engine.tokenizer.decode)
        if cache is not None:  # keyed by the request the model would see: after the policy
            answer = cache.lookup(parsed, ctx.principal.tenant, lease)
            if answer is not None:
                return self._cached(parsed, ctx, lease, call, answer)
        citations = None
        if parsed.rag is not None:
            if self.rag is None:
                raise InvalidRequest("this server has no retrieval ('rag'): it was started with "
                                     "--no-rag", param="rag")
            from jaxserve.rag.prompt import augment_chat, parse_rag_request

            rag = parse_rag_request(parsed.rag, self.rag.config.search.max_top_k)
            with timed(ctx.trace, "retrieval"):
                messages, citations = await asyncio.get_running_loop().run_in_executor(
                    self.rag.executor, augment_chat, self.rag, parsed.prompts[0], rag,
                    ctx.principal.tenant.name,
                    screening.screen_chunks if screening is not None else None)
            parsed = dataclasses.replace(parsed, prompts=[messages])
        parsed, tool_output = self._tools(parsed, lease.version.engine.tokenizer)
        engine = lease.version.engine
        gen_id = protocol.new_id("chatcmpl" if parsed.kind == "chat" else "cmpl")
        # What grows with the body (template render, tokenization, a grammar compile) runs off
        # the event loop, so a large or constrained prompt never stalls every stream (review
        # M8). The tenant's admission is taken after it, here on the loop: taken in the
        # executor, it outlived a caller that left meanwhile and was never settled (review H3).
        prepared, tool_output, degraded = await asyncio.get_running_loop().run_in_executor(
            None, self._prepare_prompts, parsed, ctx, lease, gen_id, tool_output, pins)
        if not degraded:  # a cap that changed nothing: served as asked (and canary-judged so)
            lease.degradation = None
        if not engine.is_running:
            raise EngineDead("the engine is not running; the server cannot generate")
        if engine.is_stalled:  # a request now would only wait for nothing
            raise EngineOverloaded("the engine has made no progress for a while (see GET "
                                   "/ready); retry later")
        admission, prepared = admit(engine, self.gateway, ctx, prepared,
                                    self.max_queued_requests)
        if ctx.trace is not None:  # from its arrival to its admission: parsed, screened, fitted
            ctx.trace.phase("admission", ctx.arrival, time.monotonic(),
                            **{"jaxserve.priority": int(admission.qos.priority)})
        return Generation(gen_id, parsed, prepared, admission, ctx, lease, call,
                          metrics=self.metrics, max_queued=self.max_queued_requests,
                          citations=citations, tool_output=tool_output, screening=screening,
                          degraded=degraded)

    def _cached(self, parsed: protocol.ParsedRequest, ctx: CallContext, lease: Lease,
                call: Call, answer: CachedAnswer) -> CachedAnswer:
        """A cache hit: one request of its tenant's requests_per_minute (no tokens: none are
        computed; its budget and model were checked at the edge), its call ended as `cached`
        with no tokens and no cost, and its version's lease released (a hit says nothing of
        the version)."""
        hold = self.gateway.admit_call(ctx.principal, tokens=False, holds_slot=False)
        answer_id = protocol.new_id("chatcmpl" if parsed.kind == "chat" else "cmpl")
        call.end(Outcome(answer_id, ctx, kind=parsed.kind, model=parsed.model,
                         version=answer.version, route=lease.route or "",
                         cost=0.0 if lease.version.pricing is not None else None,
                         finish_reasons=answer.finish_reasons, cached=True),
                 tenant_hold=hold, version_lease=lease)
        return replayed(answer, answer_id)

    def _parse_body(self, kind: str, body: Any) -> protocol.ParsedRequest:
        parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
        return parse(body, self.limits)

    def _parse(self, kind: str, body: Any, ctx: CallContext) -> protocol.ParsedRequest:
        parsed = self._parse_body(kind, body)
        # The edge check, before the prompt is tokenized: a tenant out of requests costs little,
        # and one that may not use the model learns nothing about what this server serves.
        self.gateway.check(ctx.principal, parsed.model)
        return parsed

    def _prepare_prompts(self, parsed: protocol.ParsedRequest, ctx: CallContext, lease: Lease,
                         gen_id: str, tool_output: ToolCallOutput,
                         pins: Sequence[Breakpoint] = ()
                         ) -> tuple[list, ToolCallOutput, tuple[str, ...]]:
        """The engine requests of `parsed` on the lease's version (on any thread; takes nothing
        from anyone): tokenized once, checked against the context and the KV pool, capped by a
        degradation, grammars compiled; and the reasons it was degraded."""
        engine = lease.version.engine
        prompt_ids = [protocol.prompt_ids(engine.tokenizer, parsed, p) for p in parsed.prompts]
        params = self._fit_context(engine, parsed, prompt_ids)
        # The whole request against the context and the KV pool, once, before a stream's headers
        # go out, so it is still a 400 and not an error inside a 200 stream.
        params = engine.check_fits([len(p) for p in prompt_ids], params)
        params = tenant_params(ctx.principal, params, parsed.max_tokens_given)
        params, degraded = degrade(lease.degradation, params)
        tool_output, params = tool_output.after_prompt(engine.tokenizer, prompt_ids[0], params)
        pins = pins or parsed.cache_breakpoints  # Anthropic's cache_control, or OpenAI's
        if pins:
            params = params.replace(cache_pins=pin_positions(
                engine.tokenizer, prompt_ids[0], pins, parsed.tools, parsed.chat_template_kwargs))
        constraint = params.structured_outputs
        # The engine's prepare compiles a constraint's grammar: that is most of its time.
        with (timed(ctx.trace, "grammar_compile", **{"jaxserve.grammar.kind": constraint.kind})
              if constraint is not None else contextlib.nullcontext()):
            prepared = prepare_requests(engine, [f"{gen_id}-{i}" for i in range(len(prompt_ids))],
                                        prompt_ids, params)
        return prepared, tool_output, degraded

    def _tools(self, parsed: protocol.ParsedRequest, tokenizer
               ) -> tuple[protocol.ParsedRequest, ToolCallOutput]:
        """tool_choice "none" (or no tools): the tools stay out of the prompt and the output is
        content. "auto": the model may call, its text is parsed. "required" / named: a grammar
        constraint makes it call (protocol refused it beside another constraint). A chat's
        reasoning is parsed, and a JSON constraint holds after it; a forced call or another
        kind of constraint writes the output from the first token, with no reasoning."""
        if parsed.kind != "chat":
            return parsed, ToolCallOutput(None)
        parsers = self.parsers.for_tokenizer(tokenizer)
        tool = parsers.tool if parsed.tool_choice.mode != "none" else None
        if tool is None:
            parsed = dataclasses.replace(parsed, tools=())
        changes = {}
        forced = tool and forced_tool_call(parsed.tools, parsed.tool_choice, tool,
                                           parallel_tool_calls=parsed.parallel_tool_calls)
        if forced is not None:
            changes["structured_outputs"] = forced
        constraint = parsed.sampling_params.structured_outputs
        thinks = forced is None and (constraint is None or constraint.kind in REASONING_KINDS)
        reasoning = parsers.reasoning if thinks else None
        if (tool is not None and tool.needs_special_tokens) or (
                reasoning is not None and parsers.reasoning_needs_special_tokens):
            changes["skip_special_tokens"] = False  # the markers must stay in the text
        if changes:
            parsed = dataclasses.replace(
                parsed, sampling_params=parsed.sampling_params.replace(**changes))
        return parsed, ToolCallOutput(tool, reasoning)

    @staticmethod
    def _fit_context(engine: ServingEngine, parsed: protocol.ParsedRequest,
                     prompt_ids: list[list[int]]):
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
