"""A keyed call's one end, whatever its transport: counted per tenant by outcome
(`jaxserve:requests`) and, with --audit-log, given its one audit record. The HTTP front door and
the gRPC service end here every call that no `Generation` ends (which counts and records its
own): the routes beside generation (embeddings, rerank, tokenize, collections, gRPC `Embed`,
`/v1/models`, gRPC `ListModels`) and the requests refused before the serving layer saw them."""

from __future__ import annotations

from jaxserve.errors import outcome
from jaxserve.entrypoints.serving.admission import CallContext


def end_call(metrics, policy, ctx: CallContext, error: BaseException | None, *,
             count: bool = True, audit: bool = True, authorization: str | None = None,
             prompt_tokens: int = 0, status_code: int = 200) -> None:
    """`metrics`: a ServerMetrics or None; `policy`: a RequestPolicy or None (no audit log).
    `count` / `audit`: False when a Generation or the serving layer does that part itself.
    `authorization`: the key sent (a 401's record names its id); `prompt_tokens`: the tokens an
    encoder read; `status_code`: that of a success."""
    if count and metrics is not None:
        tenant = ctx.principal.tenant.name if ctx.principal is not None else "none"
        metrics.record_request(tenant, outcome(error))
    if audit and policy is not None:
        policy.record_call(ctx, error, authorization, prompt_tokens, status_code)
