"""Prometheus metrics in the `jaxserve:` namespace, named after vLLM's so dashboards translate.

Engine-owned numbers (queue lengths, KV usage, token and preemption counters) are read from the
engine's stats at scrape time by a custom collector, so they can never drift from the engine's own
bookkeeping; they carry a `replica` label, one series per data-parallel replica ("0" when there
is one). Per-request latencies are histograms observed when a request ends.

Every series carries `model_name` (the model version that served) and `route` (the route the
client named; "" when it named the version, and on the engine's own numbers, which belong to a
version whatever route sent the work). The fleet's per-version counters (shadow copies, their
token agreement, canary trips) are read at scrape time too.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.telemetry import sli
from jaxserve.telemetry.sli import LATENCY_BUCKETS as _LATENCY_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    def __init__(self, stats: Callable[[], Mapping[str, Sequence[object]]]):
        self._stats = stats  # version -> one EngineStats per replica ({} while warming up)

    def collect(self):
        labels = ["model_name", "route", "replica"]
        families = {}
        for version, per_replica in self._stats().items():
            self._add(families, labels, version, per_replica)
        yield from families.values()

    @staticmethod
    def _add(families: dict, labels: list[str], version: str, per_replica) -> None:
        for replica, s in enumerate(per_replica):
            usage = s.pages_in_use / s.num_usable_pages if s.num_usable_pages else 0.0
            for kind, name, doc, value in (
                    ("gauge", "num_requests_running", "Requests in the running batch.",
                     s.num_running),
                    ("gauge", "num_requests_waiting", "Requests waiting to be scheduled.",
                     s.num_waiting),
                    ("gauge", "kv_cache_usage_perc",
                     "Fraction of KV pages held by live requests (1 = full).", usage),
                    ("gauge", "kv_cache_cached_free_pages",
                     "KV pages held only by the prefix cache (reusable, evictable).",
                     s.pages_cached_free),
                    ("counter", "prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
                    ("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     s.prefix_cache_hits),
                    ("counter", "prompt_tokens", "Prompt tokens processed.", s.prompt_tokens),
                    ("counter", "generation_tokens", "Tokens generated.", s.generation_tokens),
                    ("counter", "num_preemptions", "Requests preempted for lack of KV pages.",
                     s.num_preemptions),
                    ("gauge", "kv_cache_pins", "Prompt-cache pins held (cache_control).",
                     s.num_pins),
                    ("gauge", "kv_cache_pinned_pages",
                     "KV pages held by prompt-cache pins (a page two pins share counts twice).",
                     s.pinned_pages),
                    ("counter", "kv_cache_pins_expired",
                     "Prompt-cache pins released at the end of their TTL.", s.pins_expired),
                    ("counter", "spec_decode_num_draft_tokens",
                     "Speculative draft tokens proposed and verified.", s.num_draft_tokens),
                    ("counter", "spec_decode_num_accepted_tokens",
                     "Speculative draft tokens the model confirmed.",
                     s.num_accepted_draft_tokens),
                    ("counter", "engine_step_gaps",
                     "Gaps between consecutive engine steps measured.", s.num_step_gaps),
                    ("counter", "engine_step_gap_seconds",
                     "Host seconds between a step's tokens being ready and the next step's "
                     "launch (the device waiting for Python).", s.step_gap_seconds),
                    ("counter", "engine_steps_queued_ahead",
                     "Steps launched before the previous one finished (async scheduling).",
                     s.num_steps_queued_ahead)):
                _family(families, labels, kind, name, doc).add_metric(
                    [version, "", str(replica)], float(value))
            if s.expert_tokens:
                _add_expert_load(families, labels, [version, "", str(replica)], s)
            if s.kv_offload_capacity_pages:
                _add_kv_offload(families, labels, [version, "", str(replica)], s)


def _add_kv_offload(families: dict, labels: list[str], values: list[str], s) -> None:
    """The prefix cache's host tier (--kv-offloading-size; jaxserve.core.kv_offload) and its disk
    tier (--kv-offloading-disk-path; jaxserve.core.kv_disk), a series per tier."""
    _family(families, labels, "counter", "kv_offload_misses",
            "Prompt tokens of full pages found in neither the device prefix cache nor a KV tier "
            "below it.").add_metric(values, float(s.kv_offload_queries - s.kv_offload_hits))
    tiers = {"host": (s.kv_offload_hits - s.kv_disk_hits, s.kv_offload_bytes_to_host,
                      s.kv_offload_bytes_to_device, s.kv_offload_seconds, s.kv_offload_pages,
                      s.kv_offload_capacity_pages)}
    if s.kv_disk_capacity_pages:
        tiers["disk"] = (s.kv_disk_hits, s.kv_disk_bytes_written, s.kv_disk_bytes_read,
                         s.kv_disk_seconds, s.kv_disk_pages, s.kv_disk_capacity_pages)
    for tier, counts in tiers.items():
        for (kind, name, doc), value in zip((
                ("counter", "kv_offload_hits",
                 "Prompt tokens restored from a KV tier (host memory, disk) instead of "
                 "recomputed."),
                ("counter", "kv_offload_bytes_to_host",
                 "Bytes of KV pages copied into the tier (host: from the device; disk: files "
                 "written from host memory)."),
                ("counter", "kv_offload_bytes_to_device",
                 "Bytes of KV pages copied back from the tier (disk: read from files, checked)."),
                ("counter", "kv_offload_seconds",
                 "Host seconds spent on the tier's copies (disk: writing, reading and checking "
                 "files)."),
                ("gauge", "kv_offload_pages", "KV pages the tier holds."),
                ("gauge", "kv_offload_capacity_pages", "KV pages the tier can hold.")), counts):
            _family(families, labels + ["tier"], kind, name, doc).add_metric(
                values + [tier], float(value))


def _family(families: dict, labels: list[str], kind: str, name: str, doc: str):
    """The family of this name, made on first use (a gauge or a counter)."""
    if name not in families:
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        families[name] = family(f"jaxserve:{name}", doc, labels=labels)
    return families[name]


def _add_expert_load(families: dict, labels: list[str], values: list[str], s) -> None:
    """A mixture of experts' load (jaxserve.executor.expert_load): per expert, per
    expert-parallel device, and how uneven the devices are."""
    def family(kind: str, name: str, doc: str, extra: tuple[str, ...] = ()):
        if name not in families:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            families[name] = cls(f"jaxserve:{name}", doc, labels=[*labels, *extra])
        return families[name]

    tokens, n = s.expert_tokens, s.expert_parallel_size
    experts = family("counter", "moe_expert_tokens",
                     "Tokens routed to each expert, summed over the sparse layers (per step "
                     "and layer: divide by moe_steps and the number of sparse layers).",
                     ("expert",))
    for e, count in enumerate(tokens):
        experts.add_metric([*values, str(e)], float(count))
    family("counter", "moe_steps", "Forward steps the expert counts cover.").add_metric(
        values, float(s.expert_steps))
    per_device = [sum(tokens[d * len(tokens) // n:(d + 1) * len(tokens) // n]) for d in range(n)]
    devices = family("counter", "moe_device_tokens",
                     "Tokens routed to the experts of each expert-parallel device (device d "
                     "holds experts d*E/n to (d+1)*E/n - 1).", ("device",))
    for d, count in enumerate(per_device):
        devices.add_metric([*values, str(d)], float(count))
    mean = sum(per_device) / n
    family("gauge", "moe_device_imbalance",
           "The busiest expert-parallel device's tokens over the mean device's, since start "
           "(1: balanced).").add_metric(values, max(per_device) / mean if mean else 1.0)


class _FleetCollector:
    """Shadow copies and canary trips from the fleet's counters, per (version, route)."""

    def __init__(self, counters: Callable[[], Mapping[tuple[str, str], object]]):
        self._counters = counters

    def collect(self):
        labels = ["model_name", "route"]
        shadows = CounterMetricFamily("jaxserve:shadow_requests", "Shadow copies answered "
                                      "(never sent to a client).", labels=labels)
        compared = CounterMetricFamily("jaxserve:shadow_compared", "Greedy shadow copies "
                                       "compared token by token with their primary.",
                                       labels=labels)
        agreement = GaugeMetricFamily("jaxserve:shadow_token_agreement", "Mean fraction of a "
                                      "greedy shadow copy's tokens equal to its primary's.",
                                      labels=labels)
        trips = CounterMetricFamily("jaxserve:canary_trips", "Times the canary gate set this "
                                    "version's weight to 0.", labels=labels)
        for (route, version), c in sorted(self._counters().items()):
            shadows.add_metric([version, route], c.shadow_requests)
            compared.add_metric([version, route], c.shadow_compared)
            if c.shadow_compared:
                agreement.add_metric([version, route],
                                     c.shadow_token_agreement_sum / c.shadow_compared)
            trips.add_metric([version, route], c.canary_trips)
        yield from (shadows, compared, agreement, trips)


class _BudgetCollector:
    """The tenants' spending budgets (gateway/budgets.py), read at scrape time."""

    def __init__(self, snapshot: Callable[[], tuple[list, list]]):
        self._snapshot = snapshot

    def collect(self):
        labels = ["tenant", "period"]
        budget = GaugeMetricFamily("jaxserve:tenant_budget_usd", "The tenant's spending budget "
                                   "per UTC day or month (USD).", labels=labels)
        spent = GaugeMetricFamily("jaxserve:tenant_spend_usd", "What the tenant's requests cost "
                                  "in the current UTC day or month (USD).", labels=labels)
        used = GaugeMetricFamily("jaxserve:tenant_budget_used_ratio", "Spend over budget in the "
                                 "current period (1: spent; its requests get 429).",
                                 labels=labels)
        alerts = CounterMetricFamily("jaxserve:tenant_budget_alerts", "Alert thresholds (shares "
                                     "of a budget) crossed, once per period each.",
                                     labels=labels + ["threshold"])
        rows, crossings = self._snapshot()
        for tenant, period, limit, usd in rows:
            budget.add_metric([tenant, period], limit)
            spent.add_metric([tenant, period], usd)
            used.add_metric([tenant, period], usd / limit)
        for tenant, period, threshold, n in crossings:
            alerts.add_metric([tenant, period, f"{threshold:g}"], n)
        yield from (budget, spent, used, alerts)


class _ResponseCacheCollector:
    """The response cache (gateway/response_cache.py), read at scrape time."""

    def __init__(self, stats: Callable):
        self._stats = stats

    def collect(self):
        s = self._stats()
        hits = CounterMetricFamily("jaxserve:response_cache_hits", "Requests answered from the "
                                   "response cache.", value=s.hits)
        misses = CounterMetricFamily("jaxserve:response_cache_misses", "Cacheable requests the "
                                     "cache had no answer for (they ran).", value=s.misses)
        evictions = CounterMetricFamily("jaxserve:response_cache_evictions", "Answers dropped: "
                                        "size (LRU, past a bound), expired (TTL), invalidated "
                                        "(their route or version changed).", labels=["reason"])
        for reason, n in sorted(s.evictions.items()):
            evictions.add_metric([reason], n)
        entries = GaugeMetricFamily("jaxserve:response_cache_entries", "Answers held.",
                                    value=s.entries)
        size = GaugeMetricFamily("jaxserve:response_cache_bytes", "Bytes of the answers held.",
                                 value=s.bytes)
        yield from (hits, misses, evictions, entries, size)


class PolicyMetrics:
    """`jaxserve:policy_interventions_total{rule, action, stage}`: one count per request (input)
    or choice (output) that a rule acted on, however many matches it had there."""

    def __init__(self, registry: CollectorRegistry):
        self.interventions = Counter("jaxserve:policy_interventions",
                                     "Requests (input) or choices (output) a policy rule acted on.",
                                     ["rule", "action", "stage"], registry=registry)

    def record(self, interventions) -> None:
        """interventions: jaxserve.safety.Intervention (rule, action, stage)."""
        for i in interventions:
            self.interventions.labels(i.rule, i.action, i.stage).inc()


class KVTransferMetrics:
    """P/D disaggregation's KV transfers (jaxserve.disagg), on the side that registers them:
    role="prefill" counts the frames a prefill server sent, role="decode" those a decode server
    received (the seconds there include the prefill's compute). `skipped` counts a decode
    server's prompts that needed no transfer, by reason."""

    def __init__(self, registry: CollectorRegistry, role: str):
        self.role = role
        self.bytes = Counter("jaxserve:kv_transfer_bytes", "KV frame bytes moved.", ["role"],
                             registry=registry).labels(role)
        self.pages = Counter("jaxserve:kv_transfer_pages", "KV pages moved.", ["role"],
                             registry=registry).labels(role)
        self.seconds = Histogram("jaxserve:kv_transfer_seconds",
                                 "Per transfer: prefill asked to frame answered (prefill side) "
                                 "or checked (decode side).", ["role"],
                                 buckets=_LATENCY_BUCKETS, registry=registry).labels(role)
        self._failures = Counter("jaxserve:kv_transfer_failures", "Failed transfers, by reason.",
                                 ["role", "reason"], registry=registry)
        self._skipped = Counter("jaxserve:kv_transfer_skipped",
                                "Prompts a decode server prefilled itself, by reason.",
                                ["reason"], registry=registry)

    def sent(self, num_bytes: int, num_pages: int, seconds: float) -> None:
        self.bytes.inc(num_bytes)
        self.pages.inc(num_pages)
        self.seconds.observe(seconds)

    def failed(self, reason: str) -> None:
        self._failures.labels(self.role, reason).inc()

    def skipped(self, reason: str) -> None:
        self._skipped.labels(reason).inc()


def tenant_pseudonyms(key: bytes) -> Callable[[str], str]:
    """A tenant name -> "t-" and 12 hex digits of HMAC-SHA256(key, name): the same series for a
    tenant across restarts, and no name a reader of the metrics can try candidates against
    without the key."""
    def alias(name: str) -> str:
        return "t-" + hmac.new(key, name.encode(), hashlib.sha256).hexdigest()[:12]
    return alias


class _Pseudonymous:
    """The registry as scraped, each `tenant` label value replaced by its pseudonym ("none", no
    key matched, is nobody's)."""

    def __init__(self, registry: CollectorRegistry, alias: Callable[[str], str]):
        self._registry, self._alias = registry, alias

    def collect(self):
        for family in self._registry.collect():
            family.samples = [
                s._replace(labels={**s.labels, "tenant": self._alias(s.labels["tenant"])})
                if s.labels.get("tenant") not in (None, "none") else s for s in family.samples]
            yield family


class ServerMetrics:
    """One registry per server, so several servers (tests) never share counters."""

    def __init__(self, stats: Callable[[], Mapping[str, Sequence[object]]],
                 counters: Callable[[], Mapping[tuple[str, str], object]] = dict,
                 tenant_alias: Callable[[str], str] | None = None):
        """`stats`: version -> its replicas' EngineStats; `counters`: the fleet's;
        `tenant_alias`: tenants are shown by it (tenant_pseudonyms), not by name."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._view = (self.registry if tenant_alias is None
                      else _Pseudonymous(self.registry, tenant_alias))
        self.registry.register(_EngineCollector(stats))
        self.registry.register(_FleetCollector(counters))
        labels = ["model_name", "route"]  # .labels(version, route)

        def hist(name, doc):
            return Histogram(f"jaxserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)

        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.")
        # Per tenant: .labels(version, route, tenant)
        tenant = ["model_name", "route", "tenant"]
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds",
                              "Time from arrival to the first token.", tenant,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("jaxserve:request_queue_time_seconds",
                               "Time from arrival to first scheduling.", tenant,
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("jaxserve:requests", "Requests ended, by tenant and outcome (ok, "
                                "shed, deadline, cancelled, or the error's status_code).",
                                tenant + ["outcome"], registry=self.registry)
        self.tenant_prompt_tokens = Counter("jaxserve:tenant_prompt_tokens",
                                            "Prompt tokens of the tenant's requests.", tenant,
                                            registry=self.registry)
        self.tenant_generation_tokens = Counter("jaxserve:tenant_generation_tokens",
                                                "Tokens generated for the tenant.", tenant,
                                                registry=self.registry)
        self.cost = Counter("jaxserve:cost_usd", "The usage cost of the tenant's requests (USD; "
                            "0 without prices).", tenant, registry=self.registry)
        # The SLIs (telemetry/sli.py), per tier: .labels(version, route, tier)
        tier = list(sli.LABELS)
        self.sli_requests = Counter(sli.REQUESTS, "Calls by availability: good, bad (5xx) or "
                                    "excluded (4xx, client left).", tier + ["result"],
                                    registry=self.registry)
        self.sli_ttft = Histogram(sli.TTFT, "Time to first token, per tier.", tier,
                                  buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.sli_itl = Histogram(sli.ITL, "Time between consecutive output tokens, per tier.",
                                 tier, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.degraded = Counter("jaxserve:requests_degraded", "Requests a route degraded under "
                                "overload, by reason: max_tokens (capped), version (sent to "
                                "degrade_to); one request may count under both.",
                                tier + ["reason"], registry=self.registry)
        self.sli_streams_started = Counter(sli.STREAMS_STARTED, "Streams whose 200 went out.",
                                           tier, registry=self.registry)
        self.sli_streams_completed = Counter(sli.STREAMS_COMPLETED, "Started streams that "
                                             "reached a terminal event ([DONE], or the client "
                                             "left).", tier, registry=self.registry)

    def record_request(self, tenant: str, outcome: str, prompt_tokens: int = 0,
                       completion_tokens: int = 0, cost: float = 0.0, model_name: str = "",
                       route: str = "") -> None:
        """One ended request (jaxserve.errors.outcome); `tenant` "none" when no key matched;
        `model_name` and `route` "" when it ended before a version was chosen."""
        labels = (model_name, route, tenant)
        self.requests.labels(*labels, outcome).inc()
        self.tenant_prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.tenant_generation_tokens.labels(*labels).inc(completion_tokens)
        self.cost.labels(*labels).inc(cost)

    def register_budgets(self, snapshot: Callable[[], tuple[list, list]]) -> None:
        """`snapshot`: gateway Budgets.snapshot."""
        self.registry.register(_BudgetCollector(snapshot))

    def register_response_cache(self, stats: Callable) -> None:
        """`stats`: gateway ResponseCache.stats."""
        self.registry.register(_ResponseCacheCollector(stats))

    def record_sli(self, model_name: str, route: str, tier: str, status_code: int | None,
                   status: str, ttft_s: float | None, streamed: bool) -> None:
        """One ended call's SLI events (telemetry/sli.py); `streamed`: its SSE stream started."""
        labels = (model_name, route, tier)
        self.sli_requests.labels(*labels, sli.availability(status_code)).inc()
        if ttft_s is not None:
            self.sli_ttft.labels(*labels).observe(ttft_s)
        if streamed and sli.stream_completed(status):
            self.sli_streams_completed.labels(*labels).inc()

    def render(self) -> bytes:
        return generate_latest(self._view)
