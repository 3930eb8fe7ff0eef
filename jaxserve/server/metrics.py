"""Prometheus metrics in the `jaxserve:` namespace, named after vLLM's so dashboards translate.

Engine-owned numbers (queue lengths, KV usage, token and preemption counters) are read from the
engine's stats at scrape time by a custom collector, so they can never drift from the engine's own
bookkeeping; they carry a `replica` label, one series per data-parallel replica ("0" when there
is one). Per-request latencies are histograms observed when a request ends.
"""

from __future__ import annotations

from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], Sequence[object] | None], model_name: str):
        self._stats = stats  # one EngineStats per replica, or None while warming up
        self._model_name = model_name

    def collect(self):
        per_replica = self._stats()
        if per_replica is None:  # still warming up: no engine numbers yet
            return
        labels = ["model_name", "replica"]
        families = {}
        for replica, s in enumerate(per_replica):
            usage = s.pages_in_use / s.num_pages if s.num_pages else 0.0
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
                     s.num_preemptions)):
                if name not in families:
                    family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    families[name] = family(f"jaxserve:{name}", doc, labels=labels)
                families[name].add_metric([self._model_name, str(replica)], float(value))
        yield from families.values()


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


class ServerMetrics:
    """One registry per server, so several servers (tests) never share counters."""

    def __init__(self, stats: Callable[[], Sequence[object] | None], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]

        def hist(name, doc):
            return Histogram(f"jaxserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.model_name = model_name
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.")
        # Per tenant: .labels(model_name, tenant)
        tenant = ["model_name", "tenant"]
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

    def record_request(self, tenant: str, outcome: str, prompt_tokens: int = 0,
                       completion_tokens: int = 0, cost: float = 0.0) -> None:
        """One ended request (jaxserve.errors.outcome); `tenant` "none" when no key matched."""
        labels = (self.model_name, tenant)
        self.requests.labels(*labels, outcome).inc()
        self.tenant_prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.tenant_generation_tokens.labels(*labels).inc(completion_tokens)
        self.cost.labels(*labels).inc(cost)

    def render(self) -> bytes:
        return generate_latest(self.registry)
