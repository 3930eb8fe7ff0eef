"""Deadlines: every request ends by min(X-Request-Timeout, the tenant's request_timeout_s) after
it arrived (gRPC: the call's own deadline in place of the header), and a request not started
within the tenant's max_queue_time_s ends without generating anything. Both become absolute
`time.monotonic()` times in the request's QoS, which the scheduler enforces.
"""

from __future__ import annotations

import math

from jaxserve.errors import InvalidRequest
from jaxserve.gateway.tenants import Tenant
from jaxserve.core.request import QoS

HEADER = "X-Request-Timeout"


def parse_timeout(value: str | None) -> float | None:
    """The header's value: seconds, a positive finite number ("30", "2.5")."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequest(f"the {HEADER} header must be a positive number of seconds, got "
                             f"{value[:40]!r}", HEADER)
    return seconds


def request_qos(tenant: Tenant, arrival: float, timeout_s: float | None = None) -> QoS:
    """How the scheduler treats a request of `tenant` that arrived at `arrival` (monotonic) and
    asked for `timeout_s` (the header or the gRPC deadline; None: none)."""
    limits = [t for t in (timeout_s, tenant.request_timeout_s) if t is not None]
    return QoS(priority=tenant.priority, tenant=tenant.name, weight=tenant.weight,
               kv_page_fraction=tenant.kv_page_fraction,
               deadline=arrival + min(limits) if limits else None,
               queue_deadline=(arrival + tenant.max_queue_time_s
                               if tenant.max_queue_time_s is not None else None),
               cache_salt=cache_salt(tenant))


def cache_salt(tenant: Tenant) -> str:
    """The tenant's prefix cache salt: its sharing group's, else its own."""
    if tenant.cache_sharing_group is not None:
        return f"group:{tenant.cache_sharing_group}"
    return f"tenant:{tenant.name}"
