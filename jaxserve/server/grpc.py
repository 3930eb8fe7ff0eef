"""gRPC front end (package jaxserve.v1): streaming Generate, Embed, ListModels, health, reflection.

Requests are translated into an OpenAI completion body and validated by the same OpenAIServing
layer as HTTP, so both front ends accept and reject exactly the same things."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import RequestLimits
from jaxserve.errors import InvalidRequest, JaxServeError, error_status
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.server.openai_serving import OpenAIServing

if TYPE_CHECKING:  # the RAG stack (FAISS, bm25s) loads only when a service is passed in
    from jaxserve.rag.service import RagService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Proto3 `optional` scalars that map one-to-one onto OpenAI completion fields.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos")


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


def status_for(error: Exception) -> grpc.StatusCode:
    """The gRPC status of an error, from the one table in jaxserve.errors."""
    return grpc.StatusCode[error_status(error).grpc]


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine, model_name: str, rag: RagService | None = None,
                 max_queued_requests: int | None = None,
                 limits: RequestLimits = RequestLimits()):
        self.engine = engine
        self.serving = OpenAIServing(engine, model_name, max_queued_requests=max_queued_requests,
                                     limits=limits)
        self.model_name = model_name
        self.rag = rag

    async def Generate(self, request, context):
        try:
            gen = await self.serving.prepare_async("completion", completion_body(request))
        except JaxServeError as e:
            await context.abort(status_for(e), str(e))
        (prompt_ids,), (request_id,) = gen.prompt_ids, gen.request_ids
        sent_text, sent_tokens, finished = 0, 0, False
        try:
            async for _, out in gen.streams():
                choice = out.outputs[0]
                delta = pb.GenerateResponse(text=choice.text[sent_text:],
                                            token_ids=choice.token_ids[sent_tokens:])
                sent_text, sent_tokens = len(choice.text), len(choice.token_ids)
                if out.finished:
                    finished = True
                    delta.finish_reason = choice.finish_reason or ""
                    delta.usage.prompt_tokens = len(prompt_ids)
                    delta.usage.completion_tokens = sent_tokens
                if delta.text or delta.token_ids or out.finished:
                    yield delta
        except JaxServeError as e:  # e.g. EngineDead: the engine failed mid-stream
            await context.abort(status_for(e), str(e))
        finally:
            # Deadline expiry and client cancellation arrive here as CancelledError: free the
            # request's pages now rather than when it would have finished.
            if not finished:
                await self.engine.abort(request_id)

    async def Embed(self, request, context):
        if self.rag is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this server was started without an embedding model")
        try:
            self.rag.check_model(request.model)
            if not request.input:
                raise InvalidRequest("'input' must hold at least one string", param="input")
            # The encoder blocks: run it off the event loop, as the HTTP routes do.
            vectors, _ = await asyncio.get_running_loop().run_in_executor(
                None, self.rag.embed, list(request.input))
        except JaxServeError as e:
            await context.abort(status_for(e), str(e))
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v.tolist()) for v in vectors])

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.Model(id=self.model_name,
                                                      max_model_len=self.engine.max_model_len)])


class EngineHealthServicer(health.aio.HealthServicer):
    """gRPC health that turns NOT_SERVING once the engine loop has died (a probe restarts the
    process) or while it is stalled (no step for the stall timeout while work waits), whatever
    status was set while it ran."""

    def __init__(self, engine):
        super().__init__()
        self._engine = engine

    async def Check(self, request, context):
        response = await super().Check(request, context)
        if not self._engine.is_running or self._engine.is_stalled:
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return response


async def start_grpc_server(engine, host: str, port: int, model_name: str,
                            health_servicer: health.aio.HealthServicer | None = None,
                            rag: RagService | None = None,
                            max_queued_requests: int | None = None,
                            credentials: grpc.ServerCredentials | None = None,
                            limits: RequestLimits = RequestLimits()):
    """Start serving on host:port (0 picks a free port); returns (server, bound_port). With
    `rag`, Embed answers with its encoder (else UNIMPLEMENTED); `max_queued_requests` and
    `limits` as in OpenAIServing; with `credentials`, over TLS.

    Health reports SERVING for the service and for "" once this returns, so call it after
    the engine has warmed up."""
    server = grpc.aio.server()
    service = GenerationService(engine, model_name, rag, max_queued_requests, limits)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health_servicer or EngineHealthServicer(engine)
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
