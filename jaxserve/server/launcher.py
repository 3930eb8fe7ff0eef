"""`jaxserve serve`: HTTP (and optionally gRPC) servers over one engine: an AsyncEngine, or a
ReplicaSet of data-parallel replicas (jaxserve.parallel).

The HTTP server listens first, so /health answers and /ready says "warming up" while weights load
and every program compiles; then the engine attaches and /ready turns 200, and stdout says how long
that took (weights, compilation, total). The bound URL is printed on stdout (port 0 picks a free
one). SIGINT/SIGTERM stop the servers, then the engine thread.

Multi-host (jax.distributed): process 0 runs all of the above with a leader engine; every other
process only follows its steps (jaxserve.multihost) and exits when the leader stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from jaxserve.config import ServerConfig
from jaxserve.errors import ModelNotFound

log = logging.getLogger("jaxserve.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.engine_args import add_distributed_arguments, add_engine_arguments

    add_engine_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="also serve gRPC (jaxserve.v1) on this port (0: any free port)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: --model)")
    parser.add_argument("--keepalive-seconds", type=float, default=5.0,
                        help="SSE comment sent when a stream is idle this long")
    parser.add_argument("--log-prompts", action="store_true")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="refuse new requests (HTTP 503, gRPC RESOURCE_EXHAUSTED) while this "
                             "many sequences wait for a slot (default: no limit)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="retrieval collections live here (default: the jaxserve cache's rag/)")
    parser.add_argument("--no-rag", action="store_true",
                        help="serve generation only: no embeddings, collections or chat 'rag'")
    parser.add_argument("--ssl-certfile", type=Path, default=None,
                        help="serve HTTPS and gRPC over TLS with this PEM certificate (chain)")
    parser.add_argument("--ssl-keyfile", type=Path, default=None,
                        help="the PEM private key of --ssl-certfile")


async def serve(args: argparse.Namespace, group_leader: bool = False) -> int:
    """group_leader: this is process 0 of a multi-host group (jax.distributed initialised)."""
    from jaxserve.engine_args import engine_args
    from jaxserve.server.grpc import start_grpc_server
    from jaxserve.server.http import attach_engine, build_app, start_server
    from jaxserve.server.rag_routes import add_rag_routes
    from jaxserve.server.tls import TlsConfig

    started = time.perf_counter()
    config = ServerConfig(host=args.host, port=args.port, grpc_port=args.grpc_port,
                          served_model_name=args.served_model_name,
                          keepalive_seconds=args.keepalive_seconds, log_prompts=args.log_prompts,
                          max_queued_requests=args.max_queued_requests)
    model_name = config.served_model_name or args.model
    tls = TlsConfig.from_args(args.ssl_certfile, args.ssl_keyfile)
    scheme = "https" if tls else "http"
    app = build_app(config, model_name)
    rag = None if args.no_rag else _rag_service(args.data_dir)
    if rag is not None:
        add_rag_routes(app, rag)
    runner, port = await start_server(app, config.host, config.port,
                                      tls.ssl_context() if tls else None)
    print(f"jaxserve: warming up {model_name}; health at {scheme}://{config.host}:{port}/health",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine = grpc_server = leader = None
    try:
        if group_leader:
            from jaxserve.multihost import Leader

            leader = await loop.run_in_executor(None, Leader)
        engine = await loop.run_in_executor(None, lambda: _start_engine(args, engine_args(args),
                                                                        leader))
        if rag is not None:
            await loop.run_in_executor(None, _warm_rag, rag)
        attach_engine(app, engine, rag)
        # Replicas load and compile together: the first one's times are the set's.
        llm_engine = getattr(engine, "replicas", [engine])[0].engine
        print(f"jaxserve: ready in {time.perf_counter() - started:.1f} s (load "
              f"{llm_engine.load_seconds:.1f} s, compile {llm_engine.compile_seconds:.1f} s)",
              flush=True)
        if config.grpc_port is not None:
            grpc_server, grpc_port = await start_grpc_server(
                engine, config.host, config.grpc_port, model_name, rag=rag,
                max_queued_requests=config.max_queued_requests,
                credentials=tls.grpc_credentials() if tls else None)
            print(f"jaxserve: gRPC on {config.host}:{grpc_port}", flush=True)
        print(f"jaxserve: serving {model_name} at {scheme}://{config.host}:{port}/v1", flush=True)
        await stop.wait()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        await runner.cleanup()
        if engine is not None:
            engine.shutdown()
        if leader is not None:
            leader.close()
        if rag is not None:
            rag.close()
    return 0


def _start_engine(args: argparse.Namespace, engine_kwargs: dict, leader):
    from jaxserve.parallel import start_engine

    if leader is None:
        return start_engine(args.model, dtype=args.dtype, **engine_kwargs)
    from jaxserve import multihost

    engine = start_engine(args.model, dtype=args.dtype, agree_num_pages=leader.agree_num_pages,
                          publish=leader.publish, **multihost.group_engine_args(engine_kwargs))
    leader.watch(engine.fail)
    return engine


def _rag_service(data_dir: Path | None):
    from jaxserve.rag.config import RagConfig, default_data_dir
    from jaxserve.rag.service import RagService

    return RagService(RagConfig(data_dir or default_data_dir()))


def _warm_rag(rag) -> None:
    try:
        rag.warmup()
    except ModelNotFound as e:
        raise ModelNotFound(f"{e} (or start with --no-rag to serve generation only)") from None


def run(args: argparse.Namespace) -> int:
    from jaxserve.engine_args import distributed_config, engine_args

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist = distributed_config(args)
    if dist is None:
        return asyncio.run(serve(args))
    import jax

    from jaxserve import multihost

    multihost.initialize(dist)
    if jax.process_index() != 0:
        return multihost.run_follower(args.model, dtype=args.dtype, engine_args=engine_args(args))
    try:
        return asyncio.run(serve(args, group_leader=jax.process_count() > 1))
    finally:
        jax.distributed.shutdown()
