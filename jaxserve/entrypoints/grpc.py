"""gRPC front end (package jaxserve.v1): streaming Generate, Embed, ListModels, health, reflection.

Requests are translated into an OpenAI completion body and validated and admitted by the same
OpenAIServing layer as HTTP, so both front ends accept and reject exactly the same things (echo,
logprobs and prompt_logprobs included: the Generation computes them, this module only frames
them as messages). The
caller's key is the metadata `authorization` ("Bearer KEY"); the call's deadline is the request's;
a refusal that may pass later carries `retry-after` (seconds) in its trailing metadata, and a
request its route degraded under overload `x-jaxserve-degraded` (fleet/degrade.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import RequestLimits
from jaxserve.errors import InvalidRequest, JaxServeError, error_status, retry_after
from jaxserve.gateway.limits import retry_after_header
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.entrypoints.serving import degradation
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.logprobs import wire_logprob
from jaxserve.entrypoints.serving.offload import encoder_tokens, run_held
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.outcome import call_outcome
from jaxserve.entrypoints.serving.streams import StreamStalled, write_within
from jaxserve.entrypoints.serving.request_models import EmbeddingRequest, embedding_texts
from jaxserve.entrypoints.serving.validation import validate

if TYPE_CHECKING:  # the RAG stack (FAISS, bm25s) loads only when a service is passed in
    from jaxserve.rag.service import RagService

# Set explicitly (docs/grpc.md). A request: gRPC's usual 4 MiB, far above any prompt or
# embedding batch (an Embed request is checked as HTTP's /v1/embeddings: 2048 strings at most).
# A reply: an Embed answer of 2048 vectors of up to 1024 floats is ~8.4 MB.
MAX_RECEIVE_MESSAGE_BYTES = 4 << 20
MAX_SEND_MESSAGE_BYTES = 16 << 20
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Proto3 `optional` scalars that map one-to-one onto OpenAI completion fields.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                    "num_speculative_tokens", "echo", "logprobs", "prompt_logprobs")


def completion_body(request: pb.GenerateRequest) -> dict:
    """The OpenAI completion body equivalent to a GenerateRequest (raises InvalidRequest)."""
    if request.prompt and request.prompt_token_ids:
        raise InvalidRequest("set exactly one of 'prompt' and 'prompt_token_ids', not both",
                             param="prompt")
    if not request.prompt and not request.prompt_token_ids:
        raise InvalidRequest("one of 'prompt' and 'prompt_token_ids' is required", param="prompt")
    body = {"model": request.model,
            "prompt": request.prompt or list(request.prompt_token_ids)}
    for name in _OPTIONAL_FIELDS:
        if request.HasField(name):
            value = getattr(request, name)
            # float32 on the wire: round so 0.9 arrives as 0.9, not 0.8999999761581421.
            body[name] = round(value, 6) if isinstance(value, float) else value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.HasField("structured_outputs"):
        so = request.structured_outputs
        body["structured_outputs"] = {name: getattr(so, name) for name in
                                      ("json", "regex", "grammar", "json_object")
                                      if so.HasField(name)}
        if so.choice:
            body["structured_outputs"]["choice"] = list(so.choice)
    return body


def _top_logprobs(top: list[tuple[int, float]]) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(token_id=i, logprob=wire_logprob(v)) for i, v in top]


def token_logprobs(ids: list[int], logprobs) -> list[pb.TokenLogprob]:
    """Generated tokens' logprobs (the engine's TokenLogprob per id; None: not asked for)."""
    return [pb.TokenLogprob(token_id=t, logprob=wire_logprob(lp.logprob),
                            top_logprobs=_top_logprobs(lp.top))
            for t, lp in zip(ids, logprobs or ())]


def prompt_logprobs(ids: list[int], scores) -> list[pb.TokenLogprob]:
    """The prompt's tokens with the engine's PromptLogprob of each (None: the first token, or a
    request that ended before its prompt was scored) as TokenLogprob messages."""
    return [pb.TokenLogprob(token_id=t) if s is None else
            pb.TokenLogprob(token_id=t, logprob=wire_logprob(s.logprob), rank=s.rank,
                            top_logprobs=_top_logprobs(s.top))
            for t, s in zip(ids, scores)]


def status_for(error: Exception) -> grpc.StatusCode:
    """The gRPC status of an error, from the one table in jaxserve.errors."""
    return grpc.StatusCode[error_status(error).grpc]


async def abort_with(context, error: Exception):
    """End the call with the error's status (the table's), and `retry-after` (whole seconds) in
    the trailing metadata when the same call may pass later (429 / 503 alike)."""
    wait = retry_after(error)
    trailing = (("retry-after", retry_after_header(wait)),) if wait is not None else ()
    await context.abort(status_for(error), str(error), trailing_metadata=trailing)


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


class GenerationService(pb_grpc.GenerationServicer):
    """Generate goes through the same OpenAIServing as HTTP (`serving`: share the HTTP app's,
    so both front ends have one gateway, one set of metrics and one access log)."""

    def __init__(self, serving: OpenAIServing, rag: RagService | None = None,
                 write_timeout_s: float = 30.0):
        self.serving = serving
        self.rag = rag
        self.write_timeout_s = write_timeout_s  # the server's stream_write_timeout_s

    def _principal(self, context):
        # Throttled by the client's address, as HTTP's keys are: not its port (a new
        # connection per guess would start afresh).
        return self.serving.gateway.authenticate(_authorization(context),
                                                 context.peer().rpartition(":")[0])

    def _end(self, call: Call, ctx: CallContext, context, error: BaseException | None,
             tenant_hold=None, **kwargs) -> None:
        """End a call the serving layer did not: as HTTP's front door does."""
        call.end(call_outcome(ctx, error, authorization=_authorization(context), **kwargs),
                 tenant_hold=tenant_hold)

    async def Generate(self, request, context):
        call = Call(self.serving.sinks)
        ctx = CallContext(None, transport="grpc", client=context.peer())
        try:
            principal = self._principal(context)
            await context.send_initial_metadata(
                tuple(self.serving.gateway.headers(principal).items()))
            # The call's own deadline is the request's (capped by the tenant's timeout).
            ctx = dataclasses.replace(ctx, principal=principal,
                                      timeout_s=context.time_remaining())
            if self.serving.tracing is not None:  # metadata `traceparent`: the span's parent
                ctx = dataclasses.replace(ctx, trace=self.serving.tracing.start(
                    dict(context.invocation_metadata() or ()), ctx.arrival))
            body = completion_body(request)
        except JaxServeError as e:  # before the serving layer, which ends what it refuses
            self._end(call, ctx, context, e)
            await abort_with(context, e)
        try:
            gen = await self.serving.prepare_async("completion", body, ctx, call)
        except JaxServeError as e:
            await abort_with(context, e)
        if gen.degraded:  # trailing: the initial metadata went out before the version was chosen
            context.set_trailing_metadata(tuple(degradation.headers(gen.degraded).items()))
        # Cancellation (the client left, or its deadline passed) ends the block too: the
        # request's pages are freed now rather than when it would have finished. So does a
        # client that reads nothing (HTTP/2 flow control holds the write) for the write timeout.
        try:
            async with gen.running():
                try:
                    first = True
                    async for _, text, ids, logprobs, finish in gen.deltas():
                        delta = pb.GenerateResponse(
                            text=text, token_ids=ids, model=gen.version.name,
                            system_fingerprint=gen.version.fingerprint or "",
                            logprobs=token_logprobs(ids, logprobs))
                        if first:  # the echoed prompt and its scores lead (one prompt, n 1)
                            first = False
                            delta.text = gen.echo_prefix(0) + text
                            if gen.params.prompt_logprobs is not None:
                                delta.prompt_logprobs.extend(prompt_logprobs(
                                    gen.prompt_ids[0], gen.prompt_logprobs_of(0)))
                        if finish is not None:
                            delta.finish_reason = finish
                            delta.usage.prompt_tokens = gen.prompt_tokens
                            delta.usage.completion_tokens = sum(gen.completion_tokens.values())
                        await write_within(context.write(delta), self.write_timeout_s)
                except JaxServeError as e:  # a deadline, a shed, an engine failure mid-stream
                    gen.error = e
                    await abort_with(context, e)
        except StreamStalled as e:  # ended as a client that left: it only hears why
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Embed(self, request, context):
        if self.rag is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this server was started without an embedding model")
        call = Call(self.serving.sinks)
        ctx = CallContext(None, transport="grpc", client=context.peer(), route="grpc:Embed")
        error, num_tokens, hold = None, 0, None
        try:
            ctx = dataclasses.replace(ctx, principal=self._principal(context))
            if self.serving.policy is not None:  # a call whose record the log cannot take
                self.serving.policy.check_accepting()
            # Under the tenant's limits as HTTP's /v1/embeddings (Gateway.admit_call), settled
            # with the tokens read when the call ends.
            hold = self.serving.gateway.admit_call(ctx.principal, tokens=True, holds_slot=True)
            self.rag.check_model(request.model)
            # The same checks as HTTP's /v1/embeddings: 1 to 2048 strings, none empty.
            texts = embedding_texts(validate(EmbeddingRequest, {"model": request.model,
                                                                "input": list(request.input)}))
            # On retrieval's threads, as the HTTP routes: if the client leaves, the hold on
            # the tenant's limits lasts until the encoder is done, and pays what it read.
            vectors, num_tokens = await run_held(self.rag.executor, hold, self.rag.embed, texts,
                                                 used_tokens=encoder_tokens)
        except BaseException as e:  # JaxServeError, or the client left (cancelled)
            error = e
        finally:
            self._end(call, ctx, context, error, hold, prompt_tokens=num_tokens)
        if error is not None:
            if not isinstance(error, JaxServeError):
                raise error
            await abort_with(context, error)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v.tolist()) for v in vectors])

    async def ListModels(self, request, context):
        call = Call(self.serving.sinks)
        ctx = CallContext(None, transport="grpc", client=context.peer())
        try:
            ctx = dataclasses.replace(ctx, principal=self._principal(context))
        except JaxServeError as e:
            self._end(call, ctx, context, e, audited=False)
            await abort_with(context, e)
        # Counted, not audited: as HTTP's /v1/models, which clients poll as a health check.
        self._end(call, ctx, context, None, audited=False)
        routes, versions = self.serving.fleet.models()
        models = [pb.Model(id=name) for name in routes] + [
            pb.Model(id=v.name, max_model_len=v.engine.max_model_len,
                     system_fingerprint=v.fingerprint or "") for v in versions]
        return pb.ListModelsResponse(models=[m for m in models
                                             if ctx.principal.tenant.may_use(m.id)])


class EngineHealthServicer(health.aio.HealthServicer):
    """gRPC health that turns NOT_SERVING once every version's engine loop has died (a probe
    restarts the process) or while they are stalled (Fleet.health, as HTTP's /ready), whatever
    status was set while it ran."""

    def __init__(self, fleet):
        super().__init__()
        self._fleet = fleet

    async def Check(self, request, context):
        response = await super().Check(request, context)
        if self._fleet.health() != "ready":
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return response


async def start_grpc_server(engine, host: str, port: int, model_name: str,
                            health_servicer: health.aio.HealthServicer | None = None,
                            rag: RagService | None = None,
                            max_queued_requests: int | None = None,
                            credentials: grpc.ServerCredentials | None = None,
                            limits: RequestLimits = RequestLimits(),
                            serving: OpenAIServing | None = None,
                            write_timeout_s: float = 30.0):
    """Start serving on host:port (0 picks a free port); returns (server, bound_port). `serving`:
    the HTTP app's (http.serving_of), so both front ends share tenants, limits, metrics and the
    access log; without it, an open one of its own with `max_queued_requests` and `limits`. With
    `rag`, Embed answers with its encoder (else UNIMPLEMENTED); with `credentials`, over TLS.
    `write_timeout_s`: a Generate stream whose client reads nothing that long is ended.

    Health reports SERVING for the service and for "" once this returns, so call it after
    the engine has warmed up."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES)])
    if serving is None:
        serving = OpenAIServing(engine, model_name, max_queued_requests=max_queued_requests,
                                limits=limits)
    service = GenerationService(serving, rag, write_timeout_s)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health_servicer or EngineHealthServicer(serving.fleet)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound_port = (server.add_secure_port(address, credentials) if credentials is not None
                  else server.add_insecure_port(address))
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound_port
