"""Per-tenant spending budgets: USD per UTC day and per UTC calendar month, in the tenants file

    [tenant.acme]
    budget_usd_per_day = 50.0
    budget_usd_per_month = 1000.0
    budget_alert_thresholds = [0.5, 0.8, 1.0]      # shares of a budget (default [0.8, 1.0])
    budget_webhook = "https://ops.example/budget"  # optional: POSTed a JSON body per crossing

enforced at admission (`check`, with the gateway's edge checks, before the prompt is
tokenized): a tenant whose spend in the current day or month has reached its budget is refused
with 429 `insufficient_quota` (OpenAI's code for an exhausted quota), with Retry-After until the
period resets. A request's cost (its version's prices; gateway/pricing.py) is spent when it ends,
whatever its end (`spend`, from the request's Outcome): the same USD its usage reports. Requests
admitted before the budget was reached run to their end, so a tenant can overshoot by what its
in-flight requests cost (max_concurrent_requests bounds that).

Each threshold crossed in a period counts once (jaxserve:tenant_budget_alerts_total) and, with a
webhook, is POSTed once from a background thread (5 s timeout; a failure is logged, never
retried into the request path). The spend is kept in memory: a restart starts the current day's
and month's spend from zero.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable

from jaxserve.errors import QuotaExceeded
from jaxserve.gateway.tenants import Tenant

log = logging.getLogger("jaxserve.budgets")
PERIODS = ("day", "month")
_ADJECTIVE = {"day": "daily", "month": "monthly"}
WEBHOOK_TIMEOUT_S = 5.0


def period_key(period: str, now: float) -> str:
    """The UTC day ("2026-11-27") or month ("2026-11") `now` (epoch seconds) falls in."""
    t = datetime.fromtimestamp(now, timezone.utc)
    return t.strftime("%Y-%m-%d" if period == "day" else "%Y-%m")


def seconds_until_reset(period: str, now: float) -> float:
    t = datetime.fromtimestamp(now, timezone.utc)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        end = start + timedelta(days=1)
    else:
        first = start.replace(day=1)
        end = (first + timedelta(days=32)).replace(day=1)
    return (end - t).total_seconds()


@dataclass
class _Period:
    key: str = ""
    spent_usd: float = 0.0
    crossed: set[float] = field(default_factory=set)


def post_json(url: str, payload: dict) -> None:
    """POST `payload` to `url` off the request path (a daemon thread)."""
    def send() -> None:
        request = urllib.request.Request(url, json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S):
                pass
        except Exception as e:  # noqa: BLE001 - an unreachable webhook must not fail anyone
            log.warning("budget webhook %s failed: %s", url, e)
    threading.Thread(target=send, daemon=True, name="budget-webhook").start()


class Budgets:
    """The tenants' spend per period; `clock`: wall-clock epoch seconds (UTC periods)."""

    def __init__(self, tenants: Iterable[Tenant], clock: Callable[[], float] = time.time,
                 notify: Callable[[str, dict], None] = post_json):
        self._tenants = {t.name: t for t in tenants if t.budget_usd_per_day is not None
                         or t.budget_usd_per_month is not None}
        self._clock, self._notify = clock, notify
        self._spend = {name: {p: _Period() for p in PERIODS} for name in self._tenants}
        self._alerts: dict[tuple[str, str, float], int] = {}  # (tenant, period, threshold)
        self._lock = threading.Lock()

    @staticmethod
    def limit(tenant: Tenant, period: str) -> float | None:
        return tenant.budget_usd_per_day if period == "day" else tenant.budget_usd_per_month

    def _current(self, name: str, period: str, now: float) -> _Period:
        """The tenant's spend in the period `now` is in (a new period starts at zero)."""
        p = self._spend[name][period]
        key = period_key(period, now)
        if p.key != key:
            p.key, p.spent_usd, p.crossed = key, 0.0, set()
        return p

    def _budgeted(self, tenant: Tenant, now: float):
        """(period, budget USD, its current spend) for each period the tenant has a budget for
        (the caller holds the lock)."""
        for period in PERIODS:
            limit = self.limit(tenant, period)
            if limit is not None:
                yield period, limit, self._current(tenant.name, period, now)

    def check(self, tenant: Tenant) -> None:
        """QuotaExceeded (429 insufficient_quota) while the tenant's day or month is spent."""
        if tenant.name not in self._tenants:
            return
        with self._lock:
            now = self._clock()
            for period, limit, p in self._budgeted(tenant, now):
                spent = p.spent_usd
                if spent >= limit:
                    error = QuotaExceeded(
                        f"You exceeded your current quota: this API key's {_ADJECTIVE[period]} "
                        f"budget of "
                        f"${limit:g} is spent (${spent:.6g}); it resets at the start of the next "
                        f"UTC {period}.")
                    error.retry_after = seconds_until_reset(period, now)
                    raise error

    def spend(self, tenant_name: str | None, usd: float | None) -> None:
        """A request of the tenant's ended having cost `usd` (None or 0: nothing to count)."""
        tenant = self._tenants.get(tenant_name) if tenant_name is not None else None
        if tenant is None or not usd:
            return
        crossings = []
        with self._lock:
            now = self._clock()
            for period, limit, p in self._budgeted(tenant, now):
                p.spent_usd += usd
                for threshold in tenant.budget_alert_thresholds:
                    if threshold not in p.crossed and p.spent_usd >= threshold * limit:
                        p.crossed.add(threshold)
                        key = (tenant.name, period, threshold)
                        self._alerts[key] = self._alerts.get(key, 0) + 1
                        crossings.append({"tenant": tenant.name, "period": period,
                                          "period_start": p.key, "threshold": threshold,
                                          "spent_usd": p.spent_usd, "budget_usd": limit})
        for c in crossings:
            log.warning("tenant %s spent %.6g USD of its %s budget of %g (threshold %g)",
                        c["tenant"], c["spent_usd"], c["period"], c["budget_usd"],
                        c["threshold"])
            if tenant.budget_webhook is not None:
                self._notify(tenant.budget_webhook, c)

    def snapshot(self) -> tuple[list[tuple[str, str, float, float]],
                                list[tuple[str, str, float, int]]]:
        """([(tenant, period, budget USD, spent USD in the current period)],
        [(tenant, period, threshold, times crossed)]), for the metrics."""
        with self._lock:
            now = self._clock()
            rows = [(t.name, period, limit, p.spent_usd) for t in self._tenants.values()
                    for period, limit, p in self._budgeted(t, now)]
            return rows, [(*k, n) for k, n in self._alerts.items()]
