"""The CPU kernels' library: every C++ XLA FFI kernel of the CPU path (the attention's
attention.cc, the sampler's sampling.cc, the layers'
matmul.cc, and what they share in cpu_common.h) built into one shared library and
registered with XLA.

It is compiled on first use with the host's C++ compiler (`$CXX`, else g++), for this CPU
(-march=native), into $JAXSERVE_CACHE/kernels (default ~/.cache/jaxserve/kernels) under a name
keyed by the sources, the compiler command and the CPU's flags, so a cache shared between hosts
never hands one a binary built for another. Each load marks its library used (its mtime);
libraries no process has loaded for KERNEL_MAX_AGE_DAYS are deleted then, so the builds of past
versions do not pile up. Without a compiler, or if the build fails, `available()` is False and
the callers take their pure-JAX paths (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import jax

log = logging.getLogger(__name__)

_ROOT = Path(__file__).parent
SOURCES = (_ROOT / "attention.cc", _ROOT / "sampling.cc", _ROOT / "matmul.cc")
_HEADERS = (_ROOT / "cpu_common.h",)
# The library's handlers: target name -> symbol.
HANDLERS = {"jaxserve_paged_decode": "JaxservePagedDecode", "jaxserve_write_kv": "JaxserveWriteKv",
            "jaxserve_gather_pages": "JaxserveGatherPages",
            "jaxserve_sampling_thresholds": "JaxserveSamplingThresholds",
            "jaxserve_stacked_matmul": "JaxserveStackedMatmul"}
# Builds no process has loaded for this long are deleted (see `prune_kernels`): each upgrade, and
# each host sharing the cache, adds one; a live one is marked used every time it loads.
KERNEL_MAX_AGE_DAYS = 30


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(out: Path, command: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent first uses never load a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        subprocess.run([*command, "-o", str(part)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(part, out)


def prune_kernels(kernels: Path, used: Path, max_age_s: float) -> list[Path]:
    """Mark `used` as used now and delete the other kernel builds in `kernels` not used for
    `max_age_s`; what was deleted. Best effort: a cache this process cannot write is left as it
    is, and another process still holding a deleted library keeps its mapping."""
    try:
        os.utime(used)
        cutoff = used.stat().st_mtime - max_age_s
    except OSError as e:
        log.debug("kernel cache %s not pruned: %s", kernels, e)
        return []
    removed = []
    for lib in kernels.glob("cpu_*.so"):  # this library's builds, and those of past names
        try:  # another process may be pruning the same cache
            if lib != used and lib.stat().st_mtime < cutoff:
                lib.unlink()
                removed.append(lib)
        except OSError:
            pass
    return removed


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Build (once per sources, compiler and CPU) and register the kernels; False if they cannot
    be built here."""
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    command = [*cxx, "-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
               f"-I{jax.ffi.include_dir()}", *map(str, SOURCES)]
    texts = [p.read_text() for p in (*SOURCES, *_HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *command, _cpu_flags()]).encode())
    root = os.environ.get("JAXSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "jaxserve"
    lib = base / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    try:
        if not lib.exists():
            _build(lib, command)
        # Marked used before it loads, so no other process's prune takes it in between.
        prune_kernels(lib.parent, lib, KERNEL_MAX_AGE_DAYS * 86400)
        library = ctypes.cdll.LoadLibrary(str(lib))
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("CPU kernels unavailable: decodes and verifies use the pure-JAX attention "
                    "reference, the sampler its pure-JAX top-k/top-p, and the layers XLA's "
                    "dots on sliced weights: %s",
                    str(detail).strip()[-2000:])
        return False
    for target, symbol in HANDLERS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return True
