"""`jaxserve serve`: HTTP (and optionally gRPC) servers over a fleet of model versions: with
--model, one engine (an AsyncEngine, or a ReplicaSet of data-parallel replicas, from
jaxserve.core.engine_factory) as a fleet of one version; with --deployment, every version and route
of the file (jaxserve.fleet). --admin-key adds the admin API
(jaxserve.entrypoints.http.admin_routes).

The HTTP server listens first, so /health answers and /ready says "warming up" while weights load
and every program compiles; then the engine attaches and /ready turns 200, and stdout says how long
that took (weights, compilation, total). The bound URL is printed on stdout (port 0 picks a free
one).

SIGINT/SIGTERM end the process within a bounded time: /ready turns 503 and the listeners close,
in-flight requests get --shutdown-timeout to finish and are then cancelled (which aborts their
engine requests), then the engine thread stops. If it does not (a step that never returns), its
stack is logged and the process exits with status 1 instead of hanging; a deadline timer, and a
second signal, end it in any case. A signal during warmup exits at once.

Multi-host (jax.distributed): process 0 runs all of the above with a leader engine; every other
process only follows its steps (jaxserve.executor.multihost) and exits when the leader stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jaxserve.batches.config import HELP as _BATCH_HELP, BatchLimits
from jaxserve.config import METRICS_TENANT_LABELS, RequestLimits, ServerConfig
from jaxserve.errors import ConfigError, ModelNotFound
from jaxserve.rag.config import RagQuotas
from jaxserve.reasoning.parsers import REASONING_PARSERS
from jaxserve.tool_calling.parsers import TOOL_PARSERS

log = logging.getLogger("jaxserve.server")
_DEFAULTS = ServerConfig()
_ENGINE_STOP_S = 5.0  # for the engine thread to leave its loop once the drain is over
_DEADLINE_MARGIN_S = 15.0  # beyond drain + engine stop, before the process is ended regardless
METRICS_TOKEN_ENV = "JAXSERVE_METRICS_TOKEN"
_LIMIT_HELP = {
    "max_n": "largest `n` (and `best_of`) a request may ask",
    "max_prompts": "most prompts in one completions request",
    "max_stop": "most stop strings in one request",
    "max_stop_length": "longest stop string, in characters",
    "max_logprobs": "largest `top_logprobs` (chat) / `logprobs` (completions), at most 20",
    "max_messages": "most messages in one chat request",
    "max_body_bytes": "largest request body, in bytes",
    "max_json_depth": "deepest nesting of arrays and objects in a request body",
}
_QUOTA_HELP = {
    "max_collections": "most collections a tenant may have",
    "max_documents": "most documents over all of a tenant's collections",
    "max_bytes": "most bytes a tenant's collections may take on disk",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.disagg.config import add_disagg_arguments
    from jaxserve.entrypoints.engine_flags import (add_deployment_arguments,
                                                   add_distributed_arguments)

    add_deployment_arguments(parser)
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help="enable the admin API under /admin/v1 (load and unload versions, "
                             "change and roll back routes), for 'Authorization: Bearer KEY' only "
                             "(default: no admin API); every local user sees it in the process "
                             "list: prefer --admin-key-file or $JAXSERVE_ADMIN_KEY")
    parser.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                        help="the admin key is FILE's text (default: --admin-key, else "
                             "$JAXSERVE_ADMIN_KEY)")
    parser.add_argument("--admin-model-root", type=Path, action="append", default=None,
                        metavar="DIR",
                        help="a directory the admin API may load models from, by path "
                             "(repeatable; default: the model cache only); its chat_template "
                             "is always the template's text, never a path")
    add_distributed_arguments(parser)
    add_disagg_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="also serve gRPC (jaxserve.v1) on this port (0: any free port)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: --model)")
    parser.add_argument("--keepalive-seconds", type=float, default=5.0,
                        help="SSE comment sent when a stream is idle this long")
    parser.add_argument("--stream-write-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="end a stream (abort its request, free its KV pages) whose client "
                             "has read nothing for this long while a write waits")
    parser.add_argument("--log-prompts", action="store_true")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="refuse new requests (HTTP 503, gRPC RESOURCE_EXHAUSTED) while this "
                             "many never-started sequences wait for a slot (default: no limit)")
    parser.add_argument("--engine-stall-timeout", type=float,
                        default=_DEFAULTS.engine_stall_timeout,
                        help="/ready and gRPC health turn not-ready, and the engine thread's "
                             "stack is logged, once no step has completed this many seconds "
                             "while work is pending (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS.shutdown_timeout,
                        help="on SIGTERM, in-flight requests get this many seconds to finish "
                             "before they are aborted (default: %(default)s)")
    parser.add_argument("--tool-call-parser", default=_DEFAULTS.tool_call_parser,
                        choices=["auto", *sorted(TOOL_PARSERS)],
                        help="how a chat's output is read for tool calls: the model family's "
                             "format (default: %(default)s, from the chat template; "
                             "docs/chat-formats.md)")
    parser.add_argument("--reasoning-parser", default=_DEFAULTS.reasoning_parser,
                        choices=["auto", "none", *sorted(REASONING_PARSERS)],
                        help="how a chat's output is read for a thinking model's reasoning, "
                             "returned as reasoning_content (default: %(default)s, from the "
                             "chat template; docs/chat-formats.md)")
    limits = parser.add_argument_group("request limits (a request past one is a 400 naming the "
                                       "field)")
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                            help=f"{_LIMIT_HELP[f.name]} (default: %(default)s)")
    parser.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                        help="tenants, API keys, limits and classes (TOML; docs/tenants.md); "
                             "every route but /health, /ready, /metrics and /openapi.json then "
                             "needs 'Authorization: Bearer KEY' (default: one open tenant)")
    parser.add_argument("--auth-failures-per-minute", type=int,
                        default=_DEFAULTS.auth_failures_per_minute, metavar="N",
                        help="a client (address) whose keys failed N times in a minute is "
                             "refused (429) without its key being checked until the minute "
                             "ends (0: no limit; default: %(default)s)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="without --tenants, listen on a --host beyond loopback anyway: "
                             "anyone who reaches it may generate and read, change or delete "
                             "every collection (default: refused; docs/security.md)")
    parser.add_argument("--allowed-hosts", type=_host_list, default=None,
                        metavar="HOST[,HOST...]",
                        help="without --tenants, the Host names (and browser Origins) answered "
                             "besides loopback names and IP addresses; '*' answers any "
                             "(default: none; docs/security.md)")
    parser.add_argument("--metrics-token-file", type=Path, default=None, metavar="FILE",
                        help="/metrics needs 'Authorization: Bearer TOKEN', TOKEN read from FILE "
                             f"(or from ${METRICS_TOKEN_ENV}); without one, a server with "
                             "--tenants answers /metrics to loopback clients only")
    parser.add_argument("--metrics-tenant-labels", choices=METRICS_TENANT_LABELS,
                        default=_DEFAULTS.metrics_tenant_labels,
                        help="the tenant label of /metrics: names, or hashed (a stable "
                             "pseudonym per tenant; docs/security.md) (default: %(default)s)")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export a trace per request over OTLP/HTTP (protobuf) to URL, e.g. "
                             "http://collector:4318/v1/traces; the caller's W3C traceparent is "
                             "its parent (default: no tracing)")
    parser.add_argument("--capacity-rates", type=Path, default=None, metavar="FILE",
                        help="the rates `jaxserve capacity measure` wrote: /metrics then has "
                             "jaxserve:desired_replicas, the capacity model at the load served "
                             "(for KEDA; docs/operations.md) (default: none)")
    parser.add_argument("--capacity-headroom", type=float, default=_DEFAULTS.capacity_headroom,
                        metavar="SHARE", help="share of each replica the capacity model keeps "
                                              "free (default: %(default)s)")
    parser.add_argument("--capacity-zones", type=int, default=_DEFAULTS.capacity_zones,
                        metavar="Z", help="zones the replicas spread over: the desired "
                                          "replicas survive losing one (default: %(default)s)")
    parser.add_argument("--idempotency-ttl", type=float, default=_DEFAULTS.idempotency_ttl_s,
                        metavar="SECONDS",
                        help="how long the response to an Idempotency-Key is kept for a retry "
                             "to replay (default: %(default)s, 24 h)")
    parser.add_argument("--response-cache-size", type=int,
                        default=_DEFAULTS.response_cache_size, metavar="N",
                        help="answer exact repeats of deterministic chat and text completions "
                             "(temperature 0, or a seed) from a cache of at most N answers, "
                             "least recently used evicted first (docs/operations.md; default: "
                             "%(default)s, no cache)")
    parser.add_argument("--response-cache-bytes", type=int,
                        default=_DEFAULTS.response_cache_bytes, metavar="BYTES",
                        help="the response cache's answers take at most BYTES in all "
                             "(default: %(default)s, 64 MiB)")
    parser.add_argument("--response-cache-ttl", type=float,
                        default=_DEFAULTS.response_cache_ttl_s, metavar="SECONDS",
                        help="how long a cached answer is served (default: %(default)s)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="retrieval collections and stored responses live here (default: "
                             "the jaxserve cache's rag/)")
    parser.add_argument("--response-ttl", type=float, default=_DEFAULTS.response_ttl_s,
                        metavar="SECONDS",
                        help="how long a stored response (/v1/responses, store true) is kept, "
                             "with its run's steps and events (default: %(default)s, 7 days)")
    parser.add_argument("--code-interpreter", action="store_true",
                        help="offer the code_interpreter tool on /v1/responses: the model's "
                             "Python run in a bubblewrap sandbox (docs/agents.md; default: off)")
    parser.add_argument("--mcp-allowed-hosts", type=_host_list, default=None,
                        metavar="HOST[:PORT][,...]",
                        help="offer the mcp tool on /v1/responses for remote MCP servers on these "
                             "hosts only (a request naming another server_url: 400); the "
                             "server connects to them, so list only hosts you trust it to reach "
                             "(docs/agents.md; default: none, the tool is not offered)")
    parser.add_argument("--no-rag", action="store_true",
                        help="serve generation only: no embeddings, collections or chat 'rag'")
    quotas = parser.add_argument_group("retrieval quotas, per tenant (an upsert or a collection "
                                       "past one is a 429 insufficient_quota; docs/rag.md)")
    for f in dataclasses.fields(RagQuotas):
        quotas.add_argument(f"--rag-{f.name.replace('_', '-')}", type=int, default=f.default,
                            metavar="BYTES" if f.name == "max_bytes" else "N",
                            help=f"{_QUOTA_HELP[f.name]} (default: %(default)s)")
    batch = parser.add_argument_group("Batch API bounds (/v1/files, /v1/batches; past one: a "
                                      "400 naming the field, or a 429; docs/batch.md)")
    for f in dataclasses.fields(BatchLimits):
        batch.add_argument(f"--batch-{f.name.replace('_', '-')}", type=int, default=f.default,
                           metavar="BYTES" if f.name.endswith("bytes") else "N",
                           help=f"{_BATCH_HELP[f.name]} (default: %(default)s)")
    add_policy_arguments(parser)
    parser.add_argument("--ssl-certfile", type=Path, default=None,
                        help="serve HTTPS and gRPC over TLS with this PEM certificate (chain)")
    parser.add_argument("--ssl-keyfile", type=Path, default=None,
                        help="the PEM private key of --ssl-certfile")


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """--policy and --audit-log (serve and batch alike)."""
    parser.add_argument("--policy", type=Path, default=None, metavar="FILE",
                        help="content policy packs (TOML; docs/policy-and-audit.md): a tenant "
                             "uses its `policy` pack, others the pack `default` (default: none)")
    parser.add_argument("--audit-log", type=Path, default=None, metavar="DIR",
                        help="write one hash-chained JSON line per request to DIR "
                             "(docs/policy-and-audit.md; check it with "
                             "`jaxserve audit verify DIR`)")
    parser.add_argument("--audit-key-file", type=Path, default=None, metavar="FILE",
                        help="key the audit log's chain with the HMAC key in FILE (at least 16 "
                             "bytes; kept apart from DIR): it cannot be rewritten without the "
                             "key (`jaxserve audit verify DIR --key-file FILE`)")
    parser.add_argument("--audit-max-bytes", type=int, default=None, metavar="BYTES",
                        help="refuse audited calls (503) once the audit log's files hold this "
                             "many bytes, warning at 80%% (default: no cap)")
    parser.add_argument("--audit-min-free-bytes", type=int, default=None, metavar="BYTES",
                        help="refuse audited calls (503) while the audit log's filesystem has "
                             "less free, warning under twice it (default: 268435456, 256 MiB)")


def _host_list(text: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def _metrics_token(path: Path | None) -> str | None:
    """--metrics-token-file's token (the file's text, stripped), else $JAXSERVE_METRICS_TOKEN's;
    never a flag's value, which every local user could read in the process list."""
    if path is None:
        return os.environ.get(METRICS_TOKEN_ENV) or None
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"--metrics-token-file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"--metrics-token-file {path}: the file is empty")
    return token


def check_exposure(host: str, tenants: Path | None, allow_unauthenticated: bool) -> None:
    """An open server (no --tenants) listens on loopback only, unless --allow-unauthenticated;
    either way it says loudly that it is open."""
    from jaxserve.entrypoints.http.exposure import is_loopback

    if tenants is not None:
        return
    if is_loopback(host):
        log.warning("no --tenants: every route is open to any program on this machine (and "
                    "to web pages only through loopback names; docs/security.md)")
        return
    if not allow_unauthenticated:
        raise ConfigError(f"--host {host!r} reaches beyond this machine, and without --tenants "
                          f"anyone who reaches it may generate and read, change or delete every "
                          f"collection: give --tenants FILE (API keys), or --allow-unauthenticated "
                          f"to serve it open anyway (docs/security.md)")
    log.warning("UNAUTHENTICATED server on %r (--allow-unauthenticated): anyone who reaches it "
                "may generate and read, change or delete every collection", host)


def server_config(args: argparse.Namespace) -> ServerConfig:
    limits = RequestLimits(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(RequestLimits)})
    return ServerConfig(host=args.host, port=args.port, grpc_port=args.grpc_port,
                        served_model_name=args.served_model_name,
                        keepalive_seconds=args.keepalive_seconds, log_prompts=args.log_prompts,
                        stream_write_timeout_s=args.stream_write_timeout,
                        max_queued_requests=args.max_queued_requests, limits=limits,
                        engine_stall_timeout=args.engine_stall_timeout,
                        shutdown_timeout=args.shutdown_timeout,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        tenants_file=str(args.tenants) if args.tenants else None,
                        idempotency_ttl_s=args.idempotency_ttl,
                        response_cache_size=args.response_cache_size,
                        response_cache_bytes=args.response_cache_bytes,
                        response_cache_ttl_s=args.response_cache_ttl,
                        data_dir=str(args.data_dir) if args.data_dir else None,
                        response_ttl_s=args.response_ttl,
                        code_interpreter=args.code_interpreter,
                        mcp_allowed_hosts=args.mcp_allowed_hosts or (),
                        policy_file=str(args.policy) if args.policy else None,
                        audit_log_dir=str(args.audit_log) if args.audit_log else None,
                        audit_key_file=str(args.audit_key_file) if args.audit_key_file else None,
                        audit_max_bytes=args.audit_max_bytes,
                        audit_min_free_bytes=args.audit_min_free_bytes,
                        auth_failures_per_minute=args.auth_failures_per_minute,
                        allowed_hosts=args.allowed_hosts or (),
                        metrics_token=_metrics_token(args.metrics_token_file),
                        metrics_tenant_labels=args.metrics_tenant_labels,
                        otlp_traces_endpoint=args.otlp_traces_endpoint,
                        capacity_rates_file=(str(args.capacity_rates) if args.capacity_rates
                                             else None),
                        capacity_headroom=args.capacity_headroom,
                        capacity_zones=args.capacity_zones)


def _exit_now(code: int) -> None:
    """End the process at once, whatever its threads are doing (they may never return)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _overdue() -> None:
    log.error("shutdown did not finish in time; every thread's stack follows, then exit 1")
    faulthandler.dump_traceback(all_threads=True)
    _exit_now(1)


async def serve(args: argparse.Namespace, group_leader: bool = False, lines=None) -> int:
    """group_leader: this is process 0 of a multi-host group (jax.distributed initialised).
    `lines(serving, rag, responses)`: the Batch API's line executor (cli's:
    entrypoints/batch_lines.py, which shares the `jaxserve batch` command's line parsing; None:
    no Batch API)."""
    from jaxserve.disagg.config import disagg_config
    from jaxserve.entrypoints.engine_flags import engine_args
    from jaxserve.entrypoints.http.app_state import STATE_KEY
    from jaxserve.entrypoints.http.kv_transfer_routes import add_prefill_routes
    from jaxserve.telemetry.metrics import KVTransferMetrics
    from jaxserve.fleet.loader import EngineLoader
    from jaxserve.entrypoints.grpc import start_grpc_server
    from jaxserve.entrypoints.http.app import attach_engine, build_app, serving_of, start_server
    from jaxserve.entrypoints.http.admin_routes import (add_admin_routes, admin_key,
                                                        set_admin_fleet)
    from jaxserve.entrypoints.http.batch_routes import add_batch_routes
    from jaxserve.entrypoints.http.responses_routes import response_runner
    from jaxserve.entrypoints.tls import TlsConfig

    started = time.perf_counter()
    config = server_config(args)
    model_name = config.served_model_name or args.model or str(args.deployment)
    tls = TlsConfig.from_args(args.ssl_certfile, args.ssl_keyfile)
    scheme = "https" if tls else "http"
    disagg = disagg_config(args)
    app = build_app(config, model_name)
    if disagg.role == "prefill":
        add_prefill_routes(app, disagg.secret, KVTransferMetrics(
            app[STATE_KEY].metrics.registry, "prefill"))
    rag = None if args.no_rag else _rag_service(args.data_dir, RagQuotas(
        **{f.name: getattr(args, f"rag_{f.name}") for f in dataclasses.fields(RagQuotas)}))
    if rag is not None:
        # Imported here: BM25, FAISS and the chunker take ~0.9 s to import, and --no-rag needs none.
        from jaxserve.entrypoints.http.rag_routes import add_rag_routes

        add_rag_routes(app, rag)
    batches = _batch_service(args, rag is not None) if lines is not None else None
    if batches is not None:
        add_batch_routes(app, batches)
    key = admin_key(args)
    if key is not None:  # routes before the server starts; the fleet once loaded
        add_admin_routes(app, None, key, args.admin_model_root)
    runner, port = await start_server(app, config.host, config.port,
                                      tls.ssl_context() if tls else None, config.shutdown_timeout)
    print(f"jaxserve: warming up {model_name}; health at {scheme}://{config.host}:{port}/health",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: no more waiting
            _overdue()
        stop.set()
        deadline = threading.Timer(
            config.shutdown_timeout + _ENGINE_STOP_S + _DEADLINE_MARGIN_S, _overdue)
        deadline.daemon = True  # a shutdown that finishes in time does not wait for it
        deadline.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    if args.deployment is not None:
        load = loop.run_in_executor(None, lambda: start_fleet(
            args.deployment, stall_timeout=args.engine_stall_timeout,
            max_queued_requests=args.max_queued_requests))
    else:
        load = loop.run_in_executor(None, lambda: _start_engine(
            args, engine_args(args), group_leader, config.engine_stall_timeout))
    stopped = asyncio.ensure_future(stop.wait())
    engine = grpc_server = leader = fleet = None
    try:
        await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():  # the warmup thread cannot be interrupted; nothing was served yet
            log.info("stopped while warming up")
            await runner.cleanup()
            _exit_now(0)
        if args.deployment is not None:
            fleet = load.result()
            load_s, compile_s = _fleet_times(fleet)
        else:
            engine, leader = load.result()
            engine = _take_role(app, engine, disagg)
            load_s, compile_s = engine.load_seconds, engine.compile_seconds
            # With --admin-key, versions can be loaded beside it.
            loader = (EngineLoader(stall_timeout=args.engine_stall_timeout)
                      if key is not None else None)
            fleet = await loop.run_in_executor(None, lambda: one_version_fleet(
                args, model_name, engine, loader, args.max_queued_requests))
        if rag is not None:
            await loop.run_in_executor(None, _warm_rag, rag)
        attach_engine(app, engine, rag, fleet=fleet)
        if batches is not None:  # and resume the unfinished ones
            batches.start(lines(serving_of(app), rag, response_runner(app)))
        if key is not None:
            set_admin_fleet(app, fleet)
        print(f"jaxserve: ready in {time.perf_counter() - started:.1f} s (load "
              f"{load_s:.1f} s, compile {compile_s:.1f} s)", flush=True)
        if config.grpc_port is not None:
            grpc_server, grpc_port = await start_grpc_server(
                engine, config.host, config.grpc_port, model_name, rag=rag,
                credentials=tls.grpc_credentials() if tls else None, serving=serving_of(app),
                write_timeout_s=config.stream_write_timeout_s)
            print(f"jaxserve: gRPC on {config.host}:{grpc_port}", flush=True)
        print(f"jaxserve: serving {model_name} at {scheme}://{config.host}:{port}/v1", flush=True)
        await stopped
    finally:
        wedged = await _shutdown(app, runner, grpc_server, engine, config.shutdown_timeout,
                                 batches)
        if args.deployment is not None and fleet is not None:
            await loop.run_in_executor(None, fleet.shutdown)
        if leader is not None:
            leader.close()
        if rag is not None:
            rag.close()
    if wedged:
        _exit_now(1)
    return 0


async def _shutdown(app, runner, grpc_server, engine, timeout: float, batches) -> bool:
    """Drain, abort, stop the batches' lines (they resume on the next start), stop the engine;
    True if its thread would not stop (it is wedged)."""
    from jaxserve.entrypoints.http.app import begin_shutdown, close_app

    begin_shutdown(app)
    # Both front ends at once: listeners close, requests get `timeout`, then are cancelled and
    # their `finally` blocks abort the engine requests.
    drains = [runner.cleanup()] + ([grpc_server.stop(grace=timeout)] if grpc_server else [])
    try:
        await asyncio.wait_for(asyncio.gather(*drains), timeout + _ENGINE_STOP_S)
    except asyncio.TimeoutError:
        log.warning("requests were still open after the %.0f s drain", timeout)
    if batches is not None:
        await batches.stop()
    close_app(app)  # after the drain: every request's audit record is queued, now written
    if engine is None or engine.shutdown(_ENGINE_STOP_S):
        return False
    log.error("the engine thread did not stop (a step that never returns); its stack:\n%s",
              engine.engine_thread_stack())
    return True


def _take_role(app, engine, disagg):
    """The engine to serve as --role says: a decode server's generates from a prefill server's
    pages (jaxserve.disagg); a prefill server's also answers the KV transfer route."""
    if disagg.role == "decode":
        from jaxserve.disagg.decode_engine import DecodeEngine
        from jaxserve.disagg.prefill_client import PrefillClient

        from jaxserve.entrypoints.http.app_state import STATE_KEY
        from jaxserve.telemetry.metrics import KVTransferMetrics

        metrics = KVTransferMetrics(app[STATE_KEY].metrics.registry, "decode")
        return DecodeEngine(engine, PrefillClient(disagg.prefill_urls, disagg.secret,
                                                  disagg.prefill_timeout_s, metrics),
                            disagg.max_local_prefill_length)
    if disagg.role == "prefill":
        from jaxserve.entrypoints.http.kv_transfer_routes import set_prefill_engine

        set_prefill_engine(app, engine)
    return engine


def _start_engine(args: argparse.Namespace, settings: dict, group_leader: bool,
                  stall_timeout: float | None):
    """(the engine to serve, the multi-host Leader or None)."""
    from jaxserve.core.engine_factory import start_engine

    if not group_leader:
        return start_engine(args.model, stall_timeout=stall_timeout, **settings), None
    from jaxserve.executor import multihost

    leader = multihost.Leader()
    engine = start_engine(args.model, stall_timeout=stall_timeout,
                          agree_num_pages=leader.agree_num_pages, publish=leader.publish,
                          **multihost.group_engine_args(settings))
    leader.watch(engine.fail)
    return engine, leader


def _follow(model: str, settings: dict) -> int:
    """A follower process's life: join, build the same engine as the leader, follow its steps."""
    import jax

    from jaxserve.core.engine_factory import build_engine
    from jaxserve.executor import multihost

    follower = multihost.Follower()
    try:
        engine = build_engine(model, progress=False, agree_num_pages=follower.agree_num_pages,
                              **multihost.group_engine_args(settings))
        print(f"jaxserve: process {jax.process_index()} following the leader's steps", flush=True)
        follower.run(engine.runner)
    finally:
        # Leave jax.distributed before the leader, which hosts its coordination service and
        # waits for this connection to close.
        jax.distributed.shutdown()
        follower.close()
    return 0


def start_fleet(path: Path, *, progress: bool = True, stall_timeout: float | None = 60.0,
                max_queued_requests: int | None = None):
    """Every version of a deployment file loaded and compiled, its routes installed (a Fleet);
    one ConfigError naming the file and the field for any problem with it.
    `max_queued_requests`: the shedding threshold routes degrade below (None: none)."""
    from jaxserve.evals.gate import eval_gate_refusal
    from jaxserve.fleet.fleet import Fleet
    from jaxserve.fleet.loader import EngineLoader

    return Fleet.from_deployment(path, EngineLoader(progress=progress,
                                                    stall_timeout=stall_timeout),
                                 eval_gate=eval_gate_refusal,
                                 max_queued_requests=max_queued_requests)


def one_version_fleet(args: argparse.Namespace, name: str, engine, loader=None,
                      max_queued_requests: int | None = None):
    """--model (`serve` and `batch` alike) as a fleet of one version named as clients address
    it, with its manifest (its system_fingerprint) and pricing; `loader` (an EngineLoader) lets
    versions be loaded beside it."""
    from jaxserve.entrypoints.engine_flags import engine_args
    from jaxserve.evals.gate import eval_gate_refusal
    from jaxserve.fleet.deployment import VersionSpec
    from jaxserve.fleet.fleet import Fleet
    from jaxserve.fleet.manifest import manifest_of
    from jaxserve.gateway.pricing import pricing_for

    spec = VersionSpec.of(name, args.model, engine_args(args))
    return Fleet.of_engine(name, engine, manifest=manifest_of(spec),
                           pricing=pricing_for(args.model), loader=loader,
                           eval_gate=eval_gate_refusal, max_queued_requests=max_queued_requests)


def _fleet_times(fleet) -> tuple[float, float]:
    """(load, compile) seconds over a deployment's versions, loaded one after the other."""
    versions = [v for v in fleet.versions_info() if v["load_seconds"] is not None]
    return (sum(v["load_seconds"] for v in versions),
            sum(v["compile_seconds"] for v in versions))


def _rag_service(data_dir: Path | None, quotas: RagQuotas):
    from jaxserve.rag.config import RagConfig, default_data_dir
    from jaxserve.rag.service import RagService

    return RagService(RagConfig(data_dir or default_data_dir(), quotas=quotas))


def _batch_service(args: argparse.Namespace, embeddings: bool):
    """The Batch API's service over its store in the data directory (the default: beside the
    retrieval collections); /v1/embeddings batches only with retrieval on."""
    from jaxserve.batches.service import ENDPOINTS, BatchService
    from jaxserve.batches.store import BatchStore
    from jaxserve.rag.config import default_data_dir

    limits = BatchLimits(**{f.name: getattr(args, f"batch_{f.name}")
                            for f in dataclasses.fields(BatchLimits)})
    return BatchService(BatchStore(args.data_dir or default_data_dir()), limits,
                        tuple(e for e in ENDPOINTS if embeddings or e != "/v1/embeddings"))


def _warm_rag(rag) -> None:
    try:
        rag.warmup()
    except ModelNotFound as e:
        raise ModelNotFound(f"{e} (or start with --no-rag to serve generation only)") from None


def run(args: argparse.Namespace, lines=None) -> int:
    """`jaxserve serve`; `lines`: as serve takes it."""
    from jaxserve.entrypoints.engine_flags import (check_model_or_deployment, distributed_config,
                                                   engine_args)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_model_or_deployment(args)
    dist = distributed_config(args)
    check_exposure(args.host, args.tenants, args.allow_unauthenticated)
    if args.deployment is not None:
        if dist is not None:
            raise ConfigError("--deployment serves on one host; multi-host needs --model")
        return asyncio.run(serve(args, lines=lines))
    if dist is None:
        return asyncio.run(serve(args, lines=lines))
    import jax

    from jaxserve.executor import multihost

    multihost.initialize(dist)
    if jax.process_index() != 0:
        return _follow(args.model, engine_args(args))
    try:
        return asyncio.run(serve(args, group_leader=jax.process_count() > 1, lines=lines))
    finally:
        jax.distributed.shutdown()
