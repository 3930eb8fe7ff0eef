"""Who may reach a server that has no keys (no --tenants): any program that can open a connection
to it, and also any web page its user visits. Two browser attacks need no key on such a server:

- DNS rebinding: a page at attacker.example re-points its name at 127.0.0.1 and reads the
  answers as same-origin. Its requests carry `Host: attacker.example`, so an open server answers
  only Host names it knows: loopback names, IP literals, its bind name and `--allowed-hosts`.
- Cross-site writes (CSRF): a page POSTs to http://127.0.0.1:8000. Browsers send `Origin` on
  such requests, so an open server refuses an Origin that is not loopback or an allowed host.
  (json_body's Content-Type check refuses the no-preflight bodies too.)

A server with keys leaves both to the keys: a browser never adds `Authorization` on its own."""

from __future__ import annotations

import ipaddress

from aiohttp import web
from yarl import URL

from jaxserve.errors import Forbidden
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState

ANY_HOST = "*"  # in --allowed-hosts: no Host / Origin check


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address, a client address or a name) is this machine's loopback."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _name(url: str) -> str | None:
    """The host name of a URL (or of a Host header's `name[:port]`), lower case; None if none."""
    try:
        host = URL(url).host
    except ValueError:
        return None
    return host.lower().rstrip(".") if host else None


def _allowed_names(state: AppState) -> frozenset[str]:
    names = {h.lower().rstrip(".") for h in state.config.allowed_hosts}
    if state.config.host and not _is_ip(state.config.host):  # the name it was told to bind
        names.add(state.config.host.lower())
    return frozenset(names)


@web.middleware
async def open_server_guard(request: web.Request, handler):
    """On an open server: 403 for a Host it does not know or a foreign browser Origin."""
    state: AppState = request.app[STATE_KEY]
    allowed = _allowed_names(state)
    if not state.gateway.tenants.open or ANY_HOST in allowed:
        return await handler(request)
    host = _name(f"http://{request.host}")
    if host is None or not (host in allowed or host == "localhost" or _is_ip(host)):
        raise Forbidden(f"this server has no keys (no --tenants) and answers only Host names "
                        f"that are loopback, IP addresses or --allowed-hosts; the Host header "
                        f"names {request.host[:100]!r}")
    origin = request.headers.get("Origin")
    if origin is not None:
        name = _name(origin)
        if name is None or not (name in allowed or is_loopback(name)):
            raise Forbidden(f"this server has no keys (no --tenants) and refuses requests from "
                            f"web pages of other sites; the Origin header names "
                            f"{origin[:100]!r} (allow it with --allowed-hosts)")
    return await handler(request)
