"""JAX's persistent compilation cache: compiled XLA programs on disk, keyed by the program, the
compiler and the device, so a second start of the same model loads its programs instead of
compiling them (warmup compiles one forward per token bucket and many sampler variants)."""

from __future__ import annotations

from pathlib import Path


def default_compile_cache_dir() -> Path:
    """Under the jaxserve cache, beside the models."""
    from jaxserve.model_registry import cache_dir

    return cache_dir().parent / "xla"


def enable_compile_cache(path: Path) -> None:
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # JAX skips programs that compile in under a second by default; warmup's many small sampler
    # programs add up to most of the start on a CPU, so every program is kept.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
