"""Suite versions that `jaxserve eval run` serves itself: a model path (or registered name) with
engine settings, or a deployment file's version of the suite version's name.

Each is loaded as a fleet of one version (the fleet's loader: the same engine, manifest and
generation defaults as `jaxserve serve --deployment`) behind the HTTP app, bound to a free
loopback port for as long as its pairs run, so lm-eval reaches it exactly as it reaches a server
(the same routes, tokenizer and scoring): an in-process version scores what a served one does.
Like `jaxserve serve` without --tenants, that port is open to local programs while the run lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from typing import Iterator

from jaxserve.config import ServerConfig
from jaxserve.errors import ConfigError
from jaxserve.evals.suite import VersionSpec
from jaxserve.fleet.deployment import VersionSpec as FleetVersion
from jaxserve.fleet.deployment import load_deployment, parse_version
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.manifest import FileHashCache, manifest_of
from jaxserve.fleet.versions import VersionState


def fleet_version(version: VersionSpec) -> FleetVersion:
    """The fleet's spec of an in-process suite version (its engine settings checked by value)."""
    if version.deployment is not None:
        specs = {spec.name: spec for spec in load_deployment(version.deployment).versions}
        if version.name not in specs:
            raise ConfigError(f"version {version.name}: {version.deployment} has no "
                              f"[version.{version.name}] (it has {sorted(specs)})")
        return specs[version.name]
    return parse_version(version.name, {"model": version.path, **dict(version.engine)},
                         prefix=f"versions {version.name}: engine.")


class InProcessVersions:
    """evals.runner.InProcess over the fleet's loader."""

    def __init__(self, *, progress: bool = False):
        self.hashes = FileHashCache()  # weights hashed once for the id and the load
        self.progress = progress

    def version_id(self, version: VersionSpec) -> str:
        return manifest_of(fleet_version(version), self.hashes).id

    @contextlib.contextmanager
    def serve(self, version: VersionSpec) -> Iterator[str]:
        from jaxserve.fleet.loader import EngineLoader  # JAX: only once an engine is built

        spec = fleet_version(version)
        fleet = Fleet(EngineLoader(progress=self.progress, hashes=self.hashes))
        try:
            fleet.load(spec)
            loaded = fleet.wait(spec.name)
            if loaded.state is not VersionState.READY:
                raise ConfigError(f"version {version.name}: loading failed: {loaded.error}")
            with _http_server(fleet, spec.name, loaded.engine) as url:
                yield url
        finally:
            fleet.shutdown()


@contextlib.contextmanager
def _http_server(fleet: Fleet, name: str, engine) -> Iterator[str]:
    """The HTTP app over `fleet` on its own event-loop thread (lm-eval's client blocks this one),
    on 127.0.0.1 and a free port, its data directory a temporary one; its base URL. `engine`, its
    one version's, is the server's own as under `serve --model` (the tokenizer routes then need
    no `model`, which lm-eval does not send)."""
    from jaxserve.entrypoints.http.app import attach_engine, build_app, start_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="eval-server", daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory(prefix="jaxserve-eval-") as data_dir:
        app = build_app(ServerConfig(port=0, data_dir=data_dir), name)

        async def start():
            attach_engine(app, engine, fleet=fleet)
            return await start_server(app, "127.0.0.1", 0)

        runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(120)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()
