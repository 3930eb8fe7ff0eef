"""`jaxserve router`: one address in front of several `serve --role decode` servers, each
request sent to the least loaded one (load-aware decode choice, as sgl-router's
`--pd-disaggregation` and vLLM's disagg proxy do; the prefill choice stays prefix-aware on the
decode servers, whose --prefill-url lists rank prefill servers by the prompt's first page the
same way on every decode server).

Load: each decode server's /metrics is read every --load-interval seconds (running + waiting
requests, KV usage); of that count, the part that was this router's own requests is replaced by
their number now, so a burst between two reads spreads out and a finished request stops counting
at once. A server whose
/metrics cannot be read, or which refuses a connection, is passed over until a read succeeds
again (a refused connection ran nothing: the request tries the next server). Everything else is
passed through: method, path, query, headers (Authorization included: the decode servers
authenticate), the body (bounded by --max-body-bytes, a 413 above it), and the answer streamed
chunk by chunk as it comes (SSE unbuffered). A client that goes away cancels the handler, which
closes the upstream connection, which the decode server takes as an abort.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_LOAD_INTERVAL_S = 1.0
DEFAULT_MAX_BODY_BYTES = 32 << 20  # a 128k-token prompt's JSON is well under it
_MAX_METRICS_BYTES = 4 << 20
# Not forwarded either way: they describe one connection, not the request (RFC 9110 7.6.1), or
# are recomputed by aiohttp for the body it writes.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade", "host",
                         "content-length"})


@dataclass(frozen=True)
class RouterConfig:
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    load_interval_s: float = DEFAULT_LOAD_INTERVAL_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self):
        if not self.decode_urls:
            raise ConfigError("jaxserve router needs at least one --decode-url")
        for url in self.decode_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"--decode-url {url!r} is not an http(s) URL")
        if not 0.05 <= self.load_interval_s <= 60:
            raise ConfigError(f"--load-interval must be in [0.05, 60] seconds, got "
                              f"{self.load_interval_s}")
        if not 1024 <= self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"--max-body-bytes must be in [1024, 2**30], got "
                              f"{self.max_body_bytes}")


@dataclass(eq=False)
class _Server:
    url: str
    up: bool = False  # until its first /metrics read
    load: float = 0.0  # running + waiting at the last read
    kv_usage: float = 0.0
    in_flight: int = 0  # this router's requests there now
    in_flight_at_read: int = 0  # at the last read (counted in `load` then)
    order: int = 0

    def score(self) -> tuple:
        others = max(0.0, self.load - self.in_flight_at_read)  # other clients' requests
        return (others + self.in_flight, self.kv_usage, self.in_flight, self.order)


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.servers = [_Server(u.rstrip("/"), order=i) for i, u in enumerate(config.decode_urls)]
        self._session: aiohttp.ClientSession | None = None

    def choose(self, exclude=()) -> _Server | None:
        up = [s for s in self.servers if s.up and s not in exclude]
        return min(up, key=_Server.score, default=None)

    async def refresh(self) -> None:
        await asyncio.gather(*(self._read(s) for s in self.servers))

    async def _read(self, server: _Server) -> None:
        try:
            async with self._session.get(server.url + "/metrics", timeout=aiohttp.ClientTimeout(
                    total=max(1.0, self.config.load_interval_s))) as resp:
                resp.raise_for_status()
                text = (await resp.content.read(_MAX_METRICS_BYTES)).decode("utf-8", "replace")
            values = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            if server.up:
                log.warning("decode server %s passed over: /metrics: %s", server.url, e)
            server.up = False
            return
        server.load = (values.get("jaxserve:num_requests_running", 0.0)
                       + values.get("jaxserve:num_requests_waiting", 0.0))
        server.kv_usage = values.get("jaxserve:kv_cache_usage_perc", 0.0)
        server.in_flight_at_read = server.in_flight
        server.up = True

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            await self.refresh()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # bounded by client_max_size: a 413 above it
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        tried: list[_Server] = []
        while (server := self.choose(tried)) is not None:
            tried.append(server)
            server.in_flight += 1
            try:
                return await self._forward(request, server, headers, body)
            except aiohttp.ClientConnectorError as e:  # nothing ran there: try the next one
                log.warning("decode server %s passed over: %s", server.url, e)
                server.up = False
            finally:
                server.in_flight -= 1
        return web.json_response({"error": {
            "message": "no decode server is reachable", "type": "service_unavailable",
            "code": "no_decode_server", "param": None}}, status=503)

    async def _forward(self, request, server, headers, body) -> web.StreamResponse:
        url = server.url + request.rel_url.path_qs
        async with self._session.request(request.method, url, headers=headers,
                                         data=body if body else None) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    response.headers.add(k, v)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(self, app: web.Application):
        # No total timeout: a long generation streams for as long as it takes; connecting does.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False)
        await self.refresh()
        task = asyncio.create_task(self._refresh_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self._session.close()


def build_router_app(config: RouterConfig) -> web.Application:
    router = Router(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app.cleanup_ctx.append(router.start)
    app.router.add_route("*", "/{path:.*}", router.handle)
    return app


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode-url", action="append", required=True, metavar="URL",
                        help="a `serve --role decode` server's base URL, e.g. "
                             "http://10.0.0.6:8000 (repeatable)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address the router listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="its port (default: %(default)s; 0: any free port)")
    parser.add_argument("--load-interval", type=float, default=DEFAULT_LOAD_INTERVAL_S,
                        metavar="SECONDS",
                        help="how often each decode server's /metrics is read "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        metavar="BYTES",
                        help="a larger request body is refused with 413 (default: %(default)s)")


async def run_router(args: argparse.Namespace) -> int:
    config = RouterConfig(tuple(args.decode_url), args.host, args.port, args.load_interval,
                          args.max_body_bytes)
    runner = web.AppRunner(build_router_app(config), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"jaxserve: serving router at http://{config.host}:{port}/v1", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
    return 0
