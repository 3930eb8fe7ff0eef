"""Shadow copies: a request a route also sends to another version, whose answer nobody sees.

A copy runs the primary's request as parsed (same prompts, same sampling, the same constraint:
structured outputs or a forced tool call, whose grammar the shadow version's engine compiles for
its own tokenizer), so the two answers compare like for like. It is the least important work on
its engine: it runs at SHADOW_PRIORITY, below every tenant class, so the scheduler serves it last
and sheds it first, and a copy the engine's queue cannot take is dropped rather than refused to
anyone. It never touches the tenant's limits or the client's response. When both ends are greedy
(temperature 0, one choice each), the copy's tokens are compared with the primary's and the
fleet records the agreement.
"""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.errors import JaxServeError, version_fault
from jaxserve.core.request import QoS, ServiceClass
from jaxserve.entrypoints.serving import protocol
from jaxserve.telemetry.trace_record import Phase

log = logging.getLogger("jaxserve.shadow")

SHADOW_PRIORITY = int(ServiceClass.BATCH) + 1  # after every tenant class: served last, shed first
_TASKS: set[asyncio.Task] = set()  # strong references: a copy outlives the handler that made it


def token_agreement(primary: list[int], shadow: list[int]) -> float:
    """The fraction of positions where both answers hold the same token, over the longer one
    (1.0: the same tokens; a length difference counts as disagreement)."""
    longest = max(len(primary), len(shadow))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(primary, shadow)) / longest


def _greedy(params) -> bool:
    return params.temperature == 0 and params.n == 1


def start(lease, parsed, params, primary_tokens: asyncio.Future, max_queued: int | None,
          request_id: str, trace=None) -> None:
    """Run one shadow copy in the background, its prompts tokenized by the shadow version's own
    tokenizer. `primary_tokens` resolves to the primary's token ids per prompt once it answered
    in full (None when it did not). `trace`: the primary's RequestTrace (None: not traced); the
    copy is a `shadow` span under the primary's, whenever it ends."""
    task = asyncio.ensure_future(_traced(trace, lease, _run(
        lease, parsed, params, primary_tokens, max_queued, request_id)))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _traced(trace, lease, run) -> None:
    if trace is None:
        return await run
    started = time.monotonic()
    try:
        await run
    finally:
        trace.later(Phase("shadow", started, time.monotonic(),
                          {"gen_ai.response.model": lease.version.name}))


async def _run(lease, parsed, params, primary_tokens, max_queued, request_id) -> None:
    engine = lease.version.engine
    outputs: list[list[int]] = []
    try:
        prompt_ids = [protocol.prompt_ids(engine.tokenizer, parsed, p) for p in parsed.prompts]
        params = engine.check_fits([len(p) for p in prompt_ids], params)
        qos = QoS(priority=SHADOW_PRIORITY, tenant="shadow")

        def prepare() -> list:
            return [engine.prepare(f"{request_id}-shadow-{lease.version.name}-{i}",
                                   {"prompt_token_ids": ids}, params, qos=qos, fitted=True)
                    for i, ids in enumerate(prompt_ids)]

        # A constraint's grammar compiles here, for this version's tokenizer (one its vocabulary
        # cannot spell is an InvalidRequest: no copy): off the event loop, as the primary's.
        prepared = (await asyncio.get_running_loop().run_in_executor(None, prepare)
                    if params.structured_outputs is not None else prepare())
        engine.admit(len(prepared) * params.n, max_queued, SHADOW_PRIORITY)
    except JaxServeError:  # no room, or a request this version cannot take: no copy
        lease.release()
        return
    except asyncio.CancelledError:  # the server stops while the grammar compiles
        lease.release()
        raise
    error, started = False, asyncio.get_running_loop().time()
    ttft = None
    try:
        for p in prepared:
            last = None
            async for out in engine.generate(prepared=p):
                last = out
                if ttft is None and any(c.token_ids for c in out.outputs):
                    ttft = asyncio.get_running_loop().time() - started
            outputs.append(list(last.outputs[0].token_ids) if last and last.outputs else [])
    except asyncio.CancelledError:  # the server stops
        lease.release()
        raise
    except Exception as e:  # noqa: BLE001 - a copy's failure must never reach the client
        if not version_fault(e):  # shed or out of time: the least important work, not a fault
            lease.release()
            return
        log.warning("shadow copy on %s failed: %s", lease.version.name, e)
        error = True
    agreement = None
    if not error and _greedy(params):
        primary = await primary_tokens
        if primary is not None:
            scores = [token_agreement(a, b) for a, b in zip(primary, outputs)]
            agreement = sum(scores) / len(scores) if scores else None
    lease.finish(error=error, ttft=ttft,
                 prompt_tokens=sum(len(p.prompt_token_ids) for p in prepared),
                 completion_tokens=sum(len(o) for o in outputs), token_agreement=agreement)
