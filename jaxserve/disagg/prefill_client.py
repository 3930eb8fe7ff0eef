"""A decode server's side of the transfer: which prefill server computes a prompt, and the call.

The choice is prefix-aware: prompts whose first page (under the same cache salt) is the same go
to the same prefill server (rendezvous hashing over --prefill-url), so a shared system prompt
meets that server's prefix cache; adding or losing a server moves only its share. A server that
cannot be connected to (nothing ran there) is passed over for the next in that order; any other
failure (it went away mid-prefill, an error answer, no answer within --prefill-timeout, a frame
that does not check) fails the request with PrefillFailed (HTTP 502), never a hang.

The call is one HTTP POST on TCP: JSON in (request id, prompt token ids, cache salt), the pages'
frame out (jaxserve.disagg.transport), with the shared secret as a bearer token. Cancelling it
(the client went away) closes the connection, which cancels the prefill server's handler, whose
request is aborted there: an abort reaches both sides.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Sequence

import aiohttp
import numpy as np

from jaxserve.core.cache import extend_page_hashes
from jaxserve.core.kv_transfer import KVLayout
from jaxserve.disagg import transport
from jaxserve.errors import PrefillFailed
from jaxserve.telemetry.metrics import KVTransferMetrics

PREFILL_PATH = "/internal/kv/prefill"
_MAX_ERROR_BYTES = 2000  # of a prefill server's error answer, quoted in ours


class PrefillClient:
    def __init__(self, urls: Sequence[str], secret: str, timeout_s: float,
                 metrics: KVTransferMetrics | None = None):
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._secret = secret
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.timeout_s = timeout_s
        self.metrics = metrics

    def order(self, first_page_hash: bytes) -> list[str]:
        """The prefill servers in the order a prompt with this first page tries them."""
        return sorted(self.urls, key=lambda u: hashlib.blake2b(
            first_page_hash + u.encode(), digest_size=8).digest())

    async def prefill(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None,
                      layout: KVLayout) -> np.ndarray:
        """The prompt's full pages before its last token, computed by a prefill server,
        [layers, pages, *page] (its leading pages only, when it had lost some)."""
        started = time.monotonic()
        try:
            pages, size = await self._prefill(request_id, token_ids, cache_salt, layout)
        except PrefillFailed as e:
            self._failed(getattr(e, "reason", "error"))
            raise
        except asyncio.CancelledError:  # the client went away (or its deadline came)
            self._failed("cancelled")
            raise
        if self.metrics is not None:
            self.metrics.sent(size, pages.shape[1], time.monotonic() - started)
        return pages

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.failed(reason)

    async def _prefill(self, request_id, token_ids, cache_salt, layout) -> tuple[np.ndarray, int]:
        max_pages = (len(token_ids) - 1) // layout.page_size
        first = extend_page_hashes([], token_ids, layout.page_size, 1, cache_salt)[0]
        body = {"request_id": request_id, "prompt_token_ids": list(token_ids),
                "cache_salt": cache_salt}
        headers = {"Authorization": f"Bearer {self._secret}"}
        unreachable = []
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            for url in self.order(first):
                try:
                    frame = await self._call(session, url, body, headers,
                                             transport.max_frame_bytes(layout, max_pages))
                except aiohttp.ClientConnectorError as e:  # never connected: nothing ran there
                    unreachable.append(f"{url} ({e.os_error.strerror or e})")
                    continue
                except asyncio.TimeoutError:
                    raise _failure("timeout", f"the prefill server {url} sent no KV pages for "
                                   f"{request_id} within {self.timeout_s:g} s") from None
                except (aiohttp.ClientError, asyncio.IncompleteReadError) as e:
                    raise _failure("connection", f"the prefill server {url} failed during the "
                                   f"prefill of {request_id}: {type(e).__name__}: {e}") from None
                try:
                    # Off the event loop: checking a long prompt's frame (hundreds of MB
                    # through blake2b) would stall every stream this server is sending.
                    pages = await asyncio.to_thread(transport.decode, frame, request_id, layout,
                                                    max_pages)
                    return pages, len(frame)
                except PrefillFailed as e:
                    e.reason = "bad_frame"
                    raise
        raise _failure("unreachable",
                       f"no prefill server could be reached: {'; '.join(unreachable)}")

    @staticmethod
    async def _call(session, url: str, body: dict, headers: dict, max_bytes: int) -> bytes:
        async with session.post(url + PREFILL_PATH, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.content.read(_MAX_ERROR_BYTES)).decode("utf-8", "replace")
                raise _failure("error_status",
                               f"the prefill server {url} answered {resp.status}: {text}")
            size = resp.content_length
            if size is None or size > max_bytes:
                raise _failure("bad_frame", f"the prefill server {url} sent {size} bytes of KV "
                               f"pages (at most {max_bytes} expected)")
            return await resp.content.readexactly(size)


def _failure(reason: str, message: str) -> PrefillFailed:
    """PrefillFailed with the reason jaxserve:kv_transfer_failures_total counts it under."""
    error = PrefillFailed(message)
    error.reason = reason
    return error
