"""The Batch API's lines on the request path live traffic takes: each line is parsed as the
`jaxserve batch` command line parses it (entrypoints/batch.py `parse_line`) and answered by the
same call (`_answer`: OpenAIServing's one parse, check and admission, then the Generation, its
call ended once into the server's sinks: metrics, access log, audit log, usage), as its batch's
tenant at the lowest priority class (`ServiceClass.BATCH`: the scheduler serves every live
request first). A line counts against its tenant's limits like any request; a rate limit that
will pass is waited out, and a line refused because the engine's queue is full (or shed for a
more important request) waits and is tried again, so a batch yields to live traffic instead of
failing. /v1/embeddings lines run on the retrieval service's encoder, as the route does
(rag_routes.embeddings_response); /v1/responses lines on the server's ResponseRunner, as POST
/v1/responses runs a request that waits for its answer (serving/response_runs.py), never stored:
the output line's body is the `response` object."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from jaxserve.batches.service import Line
from jaxserve.core.request import ServiceClass
from jaxserve.entrypoints.batch import URL_KINDS, BatchLine, _answer, parse_line
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.outcome import call_outcome
from jaxserve.entrypoints.serving.request_models import EmbeddingRequest, request_models
from jaxserve.entrypoints.serving.response_runs import ResponseRunner
from jaxserve.entrypoints.serving.validation import validate
from jaxserve.errors import (EngineDead, EngineOverloaded, InvalidRequest, JaxServeError,
                             RateLimitExceeded, error_reply)
from jaxserve.gateway import Principal

log = logging.getLogger("jaxserve.batches")
ENDPOINT_KINDS = {**URL_KINDS, "/v1/embeddings": "embedding", "/v1/responses": "response"}
_OVERLOADED_RETRY_S = 0.5


def _batch_error(number: int, error: InvalidRequest) -> dict:
    """A malformed line as OpenAI's BatchError, coded as OpenAI codes its validation errors."""
    code = {None: "invalid_json_line", "url": "url_mismatch"}.get(error.param, "invalid_request")
    return {"code": code, "line": number, "param": error.param, "message": str(error)}


class ServingLines:
    """The LineExecutor (batches/service.py) of a server: `serving` its OpenAIServing, `rag` its
    RagService (None: no embeddings), `responses` its ResponseRunner (None: no /v1/responses)."""

    def __init__(self, serving: OpenAIServing, rag=None, responses: ResponseRunner | None = None):
        self.serving = serving
        self.rag = rag
        self.responses = responses

    def parse(self, endpoint: str, number: int, text: str) -> Line:
        item = parse_line(number, text, ENDPOINT_KINDS)
        if item.error is not None:
            return Line(number, item.custom_id, _batch_error(number, item.error))
        if item.kind != ENDPOINT_KINDS[endpoint]:
            return Line(number, item.custom_id, {
                "code": "url_mismatch", "line": number, "param": "url",
                "message": f"the line's 'url' is not the batch's endpoint {endpoint}"})
        model = item.body.get("model")
        return Line(number, item.custom_id, model=model if isinstance(model, str) else None,
                    payload=item)

    async def execute(self, tenant: str, key_id: str | None, line: Line) -> tuple[int, dict]:
        owner = self.serving.gateway.tenants.get(tenant)
        # The batch class, whatever the tenant's own; no queue-time bound: a line waits behind
        # live traffic for as long as its batch's window lasts.
        principal = Principal(dataclasses.replace(owner, priority=ServiceClass.BATCH,
                                                  max_queue_time_s=None), key_id)
        ctx = CallContext(principal, transport="batch")
        while True:
            try:
                return 200, await self._answer(line.payload, ctx)
            except EngineOverloaded:  # a full queue, or shed for live traffic: wait for room
                await asyncio.sleep(_OVERLOADED_RETRY_S)
            # An embeddings or a responses line's (a generation line's is waited out in _answer).
            except RateLimitExceeded as e:
                if e.retry_after is None:
                    return error_reply(e)
                await asyncio.sleep(e.retry_after)
            except EngineDead:
                raise
            except JaxServeError as e:
                return error_reply(e)
            except Exception as e:  # noqa: BLE001 - the line's 500, as the route would answer
                log.exception("batch line %s failed", line.custom_id)
                return error_reply(e)

    async def _answer(self, item: BatchLine, ctx: CallContext) -> dict:
        if item.kind == "embedding":
            return await self._embed(item, ctx)
        if item.kind == "response":
            return await self._respond(item, ctx)
        return await _answer(self.serving, item, ctx)

    async def _respond(self, item: BatchLine, ctx: CallContext) -> dict:
        """As POST /v1/responses with `store` false: the run's model turns are calls of their own
        (admitted, limited, counted, audited), its events go nowhere, its final response is the
        line's body. A refused first turn raises, as the route's plain error reply."""
        if self.responses is None:
            raise InvalidRequest("this server does not serve /v1/responses", "url")
        req = validate(request_models(self.serving.limits).responses, item.body)
        if req.background:  # a line runs to its end; nothing could fetch it later
            raise InvalidRequest("batch requests run to their end; drop 'background'",
                                 "background")
        req = req.model_copy(update={"store": False})
        job = self.responses.job(req, ctx.principal, None)
        return await self.responses.execute(job, _discard)

    async def _embed(self, item: BatchLine, ctx: CallContext) -> dict:
        """As POST /v1/embeddings: one call under the tenant's limits, ended into the sinks."""
        # Imported here: retrieval's imports take ~0.9 s, and a server without it needs none.
        from jaxserve.entrypoints.http.rag_routes import embeddings_response

        call = Call(self.serving.sinks)
        ctx = dataclasses.replace(ctx, route="/v1/embeddings")
        lease, used, error = None, [0], None
        try:
            if self.rag is None:
                raise InvalidRequest("this server has no embeddings: it was started with "
                                     "--no-rag", "url")
            body = validate(EmbeddingRequest, item.body)
            lease = self.serving.gateway.admit_call(ctx.principal, tokens=True, holds_slot=True)
            return await embeddings_response(self.rag, body, lease,
                                             lambda tokens: used.__setitem__(0, tokens))
        except BaseException as e:
            error = e
            raise
        finally:
            call.end(call_outcome(ctx, error, prompt_tokens=used[0]), tenant_hold=lease)


async def _discard(event: dict | None) -> None:
    """A batch line's events: only its final response is kept."""
