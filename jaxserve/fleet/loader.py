"""Turning a VersionSpec into a serving engine: check it and plan its memory (fast, metadata only),
then load the weights, compile every program and hash its manifest (slow, on the fleet's loading
thread); and back again, freeing the device memory.

The Fleet holds a loader rather than building engines itself, so its routing, draining and memory
accounting are tested with fake engines in milliseconds; this is the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.core.engine_factory import start_engine
from jaxserve.core.serving_engine import ServingEngine
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.fleet.manifest import FileHashCache, Manifest, build_manifest, resolve_version
from jaxserve.fleet.memory import MemoryPlan, plan_memory
from jaxserve.gateway.pricing import Pricing


@dataclass(frozen=True)
class Prepared:
    memory: MemoryPlan
    pricing: Pricing | None
    detail: Any = None  # the loader's own (the real one: the ResolvedVersion)


@dataclass(frozen=True)
class Loaded:
    engine: ServingEngine
    manifest: Manifest
    load_seconds: float
    compile_seconds: float


class EngineLoader:
    """A version's engine from the engine factory: an AsyncEngine, or a ReplicaSet when the
    version sets data_parallel_size."""

    def __init__(self, *, strict_compile: bool = False, progress: bool = False,
                 hashes: FileHashCache | None = None, stall_timeout: float | None = 60.0):
        """stall_timeout: each version's AsyncEngine's (`serve --engine-stall-timeout`)."""
        self.strict_compile = strict_compile
        self.stall_timeout = stall_timeout
        self.progress = progress
        self.hashes = hashes or FileHashCache()

    def free_bytes(self) -> int:
        from jaxserve.executor.parallel import free_device_memory

        return free_device_memory()

    def prepare(self, spec: VersionSpec, budget_bytes: int) -> Prepared:
        resolved = resolve_version(spec)
        return Prepared(plan_memory(resolved.engine_config, budget_bytes), resolved.pricing,
                        resolved)

    def load(self, spec: VersionSpec, prepared: Prepared) -> Loaded:
        engine = start_engine(
            spec.model, dtype=spec.dtype, strict_compile=self.strict_compile,
            progress=self.progress, stall_timeout=self.stall_timeout,
            **{**dict(spec.engine_args), "num_pages": prepared.memory.num_pages})
        try:
            manifest = build_manifest(prepared.detail, engine.tokenizer.chat_template,
                                      self.hashes)
        except BaseException:
            self.unload(engine)
            raise
        return Loaded(engine, manifest, engine.load_seconds, engine.compile_seconds)

    def unload(self, engine: ServingEngine) -> None:
        engine.shutdown()
        engine.close()
