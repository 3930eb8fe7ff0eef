"""The HTTP app's state: its configuration, the gateway (tenants, limits), the idempotency store,
the metrics, the request policy (filters, audit log), the sinks every call's outcome goes to,
and the serving layer once the engine is warm. Read at build time, so a bad tenants or policy
file fails the start."""

from __future__ import annotations

import hashlib
from pathlib import Path

from aiohttp import web

from jaxserve.audit import audit_log_config
from jaxserve.config import ServerConfig
from jaxserve.errors import EngineOverloaded
from jaxserve.gateway import Gateway, load_tenants
from jaxserve.gateway.idempotency import IdempotencyStore
from jaxserve.gateway.pricing import Pricing
from jaxserve.gateway.response_cache import ResponseCache
from jaxserve.telemetry.capacity import CapacityCollector, read_rates
from jaxserve.telemetry.metrics import PolicyMetrics, ServerMetrics, tenant_pseudonyms
from jaxserve.entrypoints.serving.calls import Sinks
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.request_policy import RequestPolicy


class AppState:
    """The app's state. The engine arrives after warmup: until then /health answers and /ready
    and the generation endpoints say the server is warming up."""

    def __init__(self, config: ServerConfig, model_name: str):
        self.config = config
        self.model_name = model_name
        # Read at build time: a bad tenants file is one error at start, naming file and field.
        self.gateway = Gateway(load_tenants(config.tenants_file) if config.tenants_file
                               else None,
                               auth_failures_per_minute=config.auth_failures_per_minute)
        self.idempotency = IdempotencyStore(config.idempotency_ttl_s)
        # --response-cache-size 0 (the default): no response cache.
        self.response_cache = (ResponseCache(config.response_cache_size,
                                             config.response_cache_bytes,
                                             config.response_cache_ttl_s)
                               if config.response_cache_size else None)
        self.serving: OpenAIServing | None = None
        self.metrics = ServerMetrics(self._stats, self._counters, tenant_alias=(
            tenant_pseudonyms(self._pseudonym_key())
            if config.metrics_tenant_labels == "hashed" else None))
        # Read at build time too: a bad policy file or audit directory fails the start.
        self.policy = RequestPolicy.open(
            config.policy_file, audit_log_config(config.audit_log_dir, config.audit_key_file,
                                                 config.audit_max_bytes,
                                                 config.audit_min_free_bytes),
            PolicyMetrics(self.metrics.registry), self.gateway.tenants.tenants.values())
        if self.policy is not None and self.policy.audit is not None:
            self.policy.audit.register_metrics(self.metrics.registry)
        # Where every call ends (front door, gRPC, generations): counted, logged, audited.
        self.sinks = Sinks(self.metrics, self.policy, config.log_prompts)
        # Each request's cost is spent from its tenant's budgets (gateway/budgets.py).
        self.sinks.add(lambda o: self.gateway.budgets.spend(o.tenant, o.cost))
        self.metrics.register_budgets(self.gateway.budgets.snapshot)
        if self.response_cache is not None:
            self.metrics.register_response_cache(self.response_cache.stats)
        if config.capacity_rates_file:  # read at build time: a bad file fails the start
            self.metrics.registry.register(CapacityCollector(
                self._stats, read_rates(Path(config.capacity_rates_file)),
                config.capacity_headroom, config.capacity_zones))
        self.tracing = None  # OpenTelemetry is imported only when traces are exported
        if config.otlp_traces_endpoint:
            from jaxserve.telemetry.tracing import Tracing

            self.tracing = Tracing(config.otlp_traces_endpoint)
            self.sinks.add(self.tracing.sink)
        self.shutting_down = False  # set on SIGTERM: not ready while in-flight requests drain
        self.openapi: dict | None = None  # built on first request, once every route is added

    def _pseudonym_key(self) -> bytes:
        # From the tenants' key digests: stable while the keys are, and unknown to a reader of
        # the metrics.
        return hashlib.sha256(b"".join(sorted(self.gateway.tenants.by_digest))).digest()

    def _stats(self) -> dict:
        if self.serving is None:  # warming up: no engine numbers yet
            return {}
        return {name: engine.replica_stats()
                for name, engine in self.serving.fleet.metered_engines().items()}

    def _counters(self) -> dict:
        return {} if self.serving is None else self.serving.fleet.counters()

    def attach(self, engine, rag=None, pricing: Pricing | None = None, fleet=None) -> None:
        self.serving = OpenAIServing(engine, self.model_name, self.metrics, rag,
                                     self.config.max_queued_requests, self.config.limits,
                                     self.config.tool_call_parser, self.gateway, pricing, fleet,
                                     self.policy, self.sinks,
                                     reasoning_parser=self.config.reasoning_parser,
                                     tracing=self.tracing)
        if self.response_cache is not None:  # a route's or version's change drops its answers
            self.serving.fleet.on_change(self.response_cache.invalidate)

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise EngineOverloaded("the server is warming up; retry when GET /ready answers 200")
        return self.serving


STATE_KEY = web.AppKey("state", AppState)
