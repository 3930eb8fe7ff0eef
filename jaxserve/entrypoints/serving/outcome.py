"""`Outcome`: how one call ended, built once where it ended and read by every sink (calls.py).

A call ends in one of three places: its `Generation` (an admitted request: finished,
content_filter, aborted, deadline, shed while queued, an engine error), the serving layer's
refusal (`OpenAIServing.prepare_async`: a bad body, 404, 429, context length, a full queue), or its
transport (an idempotent replay, a 401 or a body refused before the serving layer saw it, and the
calls beside generation: embeddings, rerank, tokenize, collections, /v1/models, gRPC Embed and
ListModels, a malformed batch line). Each builds the call's one Outcome there; nothing downstream
re-derives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import error_status, outcome
from jaxserve.gateway.keys import presented_key_id
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.protocol import new_id
from jaxserve.entrypoints.serving.screening import Screening


@dataclass(frozen=True)
class Outcome:
    request_id: str
    ctx: CallContext  # who called (None: a 401), by which transport and path, when it arrived
    error: BaseException | None = None  # None: answered in full
    success_code: int = 200  # the HTTP status of a success (201: a collection created)
    kind: str = ""  # "chat" | "completion" for a generation request; "" for any other call
    model: str | None = None  # the model the request named
    version: str | None = None  # the version chosen for it (None: none was chosen)
    route: str = ""  # the fleet route that chose the version ("": named directly); the HTTP
    # path is ctx.route
    served: bool = False  # it ran on that version (a Generation): the version's and the
    # tenant's usage and latency count it
    prompt_tokens: int = 0  # of a served request, or the tokens an encoder read
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the prefix cache (priced at its rate)
    cost: float | None = None  # USD; None without prices
    finish_reasons: tuple[str, ...] = ()  # per choice; "" for one that never finished
    first_token_at: float | None = None  # monotonic, as ctx.arrival
    ended_at: float = field(default_factory=time.monotonic)
    screening: Screening | None = None  # what the tenant's policy did to it (served requests)
    prompts: Any = None  # the parsed prompts (the access log's, with --log-prompts)
    idempotent_replay: bool = False
    cached: bool = False  # answered from the response cache: nothing computed, no cost
    presented_key_id: str | None = None  # the id of the key a refused caller sent (a 401)
    audited: bool = True  # False: a model-list poll, or a keyless caller's unrouted request
    streamed: bool = False  # its SSE stream started (its 200 went out)
    degraded: tuple[str, ...] = ()  # why its route degraded it ("max_tokens", "version")

    @property
    def status(self) -> str:
        """"ok", "shed", "deadline", "client_disconnected" or the error's status and code (the
        `outcome` label of jaxserve:requests_total, the access log's and audit log's status)."""
        return outcome(self.error)

    @property
    def status_code(self) -> int | None:
        """The HTTP status it was answered with (gRPC's and a batch line's equivalent); None for
        a client that left."""
        if self.error is None:
            return self.success_code
        return None if self.status == "client_disconnected" else error_status(self.error).http

    @property
    def tenant(self) -> str | None:
        return self.ctx.principal.tenant.name if self.ctx.principal is not None else None

    @property
    def tier(self) -> str:
        """The tenant's scheduling class (the SLIs' `tier`); "none" for a refused key."""
        principal = self.ctx.principal
        return principal.tenant.priority.name.lower() if principal is not None else "none"

    @property
    def key_id(self) -> str | None:
        """The accepted key's id, else that of the key a refused caller sent."""
        principal = self.ctx.principal
        return principal.key_id if principal is not None else self.presented_key_id

    @property
    def used_tokens(self) -> int:
        """What the tenant's limits are settled with."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def total_s(self) -> float:
        return self.ended_at - self.ctx.arrival

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_at is None:
            return None
        return round(self.first_token_at - self.ctx.arrival, 4)


def call_outcome(ctx: CallContext, error: BaseException | None, *,
                 authorization: str | None = None, prompt_tokens: int = 0,
                 success_code: int = 200, audited: bool = True) -> Outcome:
    """The outcome of a call its transport ended: a call beside generation (`prompt_tokens`: the
    tokens an encoder read), or one refused before the serving layer saw it, known by what its
    transport read (`authorization`: the key sent, whose id a 401's audit record names)."""
    return Outcome(new_id("req"), ctx, error, success_code, prompt_tokens=prompt_tokens,
                   presented_key_id=presented_key_id(authorization), audited=audited)
