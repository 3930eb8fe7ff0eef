"""DecodeEngine: the serving engine of `serve --role decode`.

It is the ServingEngine it wraps (an AsyncEngine: every member is that engine's) but for
`generate`, which first has a prefill server compute the prompt's full pages (PrefillClient),
puts them in this engine's host KV tier (jaxserve.core.kv_transfer.import_prefix), and then
generates here, where admission restores them as a prefix-cache hit and computes only the
prompt's last page. Skipped when there is nothing to hand over (a prompt shorter than a page and
a token), when the prompt's pages are all in this engine's prefix cache already, when the prompt
tokens not in that cache are at most --max-local-prefill-length (computing them here is cheaper
than a round trip: NVIDIA Dynamo's conditional disaggregation rule), and for prompt logprobs
(every prompt position is scored where the request runs); each skip is counted by reason
(jaxserve:kv_transfer_skipped_total). A failed prefill ends the
request before it reaches this engine (PrefillFailed), and so does the request's deadline
(DeadlineExceeded) when it comes first; leaving the stream while the prefill runs cancels the
call (the prefill server aborts its request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from jaxserve.core.async_engine import AsyncEngine, resolve_final
from jaxserve.core.cache import extend_page_hashes
from jaxserve.core.kv_transfer import import_prefix, kv_layout
from jaxserve.core.preparation import PreparedRequest
from jaxserve.disagg.prefill_client import PrefillClient
from jaxserve.errors import ConfigError, DeadlineExceeded


class DecodeEngine:
    def __init__(self, engine: AsyncEngine, client: PrefillClient,
                 max_local_prefill_length: int = 0):
        if not isinstance(engine, AsyncEngine):
            raise ConfigError("--role decode serves one engine (no --data-parallel-size)")
        self._engine = engine
        self.client = client
        self.max_local_prefill_length = max_local_prefill_length
        self.layout = kv_layout(engine.engine)  # ConfigError without the host tier

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt=None, params=None, request_id: str | None = None,
                       priority: int = 0, *, qos=None, prepared: PreparedRequest | None = None,
                       final: asyncio.Future | None = None):
        try:
            if prepared is None:
                prepared = self._engine.prepare(request_id or f"req-{uuid.uuid4().hex}", prompt,
                                                params, priority, qos=qos)
            await self._prefill(prepared)
        except BaseException:  # it never reached this engine (its prefill server's is its own)
            resolve_final(final, None)
            raise
        async with contextlib.aclosing(self._engine.generate(prepared=prepared,
                                                             final=final)) as stream:
            async for out in stream:
                yield out

    async def _prefill(self, prepared: PreparedRequest) -> None:
        ids, salt = prepared.prompt_token_ids, prepared.qos.cache_salt
        num_pages = (len(ids) - 1) // self.layout.page_size
        if prepared.params.prompt_logprobs is not None:
            return self._skip("prompt_logprobs")
        if num_pages == 0:
            return self._skip("short_prompt")
        hashes = extend_page_hashes([], ids, self.layout.page_size, num_pages, salt)
        # A hint read off the engine thread (count_cached_prefix): at worst one needless prefill.
        cached = self._engine.engine.scheduler.cache.count_cached_prefix(hashes)
        if cached == num_pages:
            return self._skip("cached")
        if len(ids) - cached * self.layout.page_size <= self.max_local_prefill_length:
            return self._skip("short_prompt")
        prefill = self.client.prefill(prepared.request_id, ids, salt, self.layout)
        deadline = prepared.qos.deadline
        if deadline is None:
            pages = await prefill
        else:  # the request's own deadline bounds the wait too (X-Request-Timeout, a tenant's)
            try:
                pages = await asyncio.wait_for(prefill, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"request {prepared.request_id} ran out of time waiting "
                                       f"for its prefill") from None
        await self._engine.call(lambda engine: import_prefix(engine, ids, salt, pages))

    def _skip(self, reason: str) -> None:
        if self.client.metrics is not None:
            self.client.metrics.skipped(reason)
