"""The CPU kernels' library: every C++ XLA FFI kernel of the CPU path (each `*.cc` in this
folder, and what they share in its `*.h` headers) built into one shared library and registered
with XLA.

Adding a kernel touches two places: its `.cc` here, which defines its handler with
`XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSomeName, ...)`, and its Python wrapper, which calls the
FFI target `jaxserve_some_name` (the symbol in snake case; see `handlers`). The library compiles
every source here and registers every handler the sources define.

It is compiled with the host's C++ compiler (`$CXX`, else g++), for this CPU (-march=native), into
$JAXSERVE_CACHE/kernels (default ~/.cache/jaxserve/kernels) under a name keyed by the sources, the
compiler command and the CPU's flags, so a cache shared between hosts never hands one a binary
built for another. `jaxserve kernels build` builds it ahead of time (for images); otherwise the
first engine that asks for the kernels (`jaxserve.kernels.cpu.enabled`) builds it. Each load
marks its library used (its mtime); libraries no process has loaded for KERNEL_MAX_AGE_DAYS are
deleted then, so the builds of past versions do not pile up. Without a compiler, or if the build
fails, `load()` says why and the callers take their pure-JAX paths (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxserve.errors import JaxServeError

log = logging.getLogger(__name__)

_ROOT = Path(__file__).parent
# Builds no process has loaded for this long are deleted (see `prune_kernels`): each upgrade, and
# each host sharing the cache, adds one; a live one is marked used every time it loads.
KERNEL_MAX_AGE_DAYS = 30
_HANDLER = re.compile(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)\s*,")


class KernelBuildError(JaxServeError):
    """The CPU kernels' library cannot be built or loaded here."""


def sources() -> list[Path]:
    """The library's C++ sources: every `.cc` in this folder."""
    return sorted(_ROOT.glob("*.cc"))


def headers() -> list[Path]:
    return sorted(_ROOT.glob("*.h"))


def target_name(symbol: str) -> str:
    """A handler symbol's FFI target: JaxservePagedDecode -> jaxserve_paged_decode."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", symbol).lower()


def handlers() -> dict[str, str]:
    """FFI target -> handler symbol, for every handler the sources define."""
    symbols = [s for path in sources() for s in _HANDLER.findall(path.read_text())]
    return {target_name(s): s for s in symbols}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@dataclass(frozen=True)
class Build:
    """This host's build of the library: the compile command, the key of its inputs (sources,
    command, CPU flags) and where the library lies (or will)."""

    command: tuple[str, ...]
    key: str
    path: Path

    @property
    def compiler(self) -> str:
        return self.command[0]


def plan() -> Build:
    """The build this host would use now (nothing is compiled)."""
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    command = (*cxx, "-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
               f"-I{jax.ffi.include_dir()}", *map(str, sources()))
    texts = [p.read_text() for p in (*sources(), *headers())]
    key = hashlib.sha256("\0".join([*texts, *command, _cpu_flags()]).encode()).hexdigest()[:16]
    root = os.environ.get("JAXSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "jaxserve"
    return Build(command, key, base / "kernels" / f"cpu_kernels-{key}.so")


def _compile(out: Path, command: tuple[str, ...]) -> None:
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


def build(b: Build) -> ctypes.CDLL:
    """Compile `b` unless it is built, mark it used, load it, and check it holds every handler;
    KernelBuildError (saying why) if any of that fails."""
    try:
        if not b.path.exists():
            _compile(b.path, b.command)
        # Marked used before it loads, so no other process's prune takes it in between.
        prune_kernels(b.path.parent, b.path, KERNEL_MAX_AGE_DAYS * 86400)
        library = ctypes.cdll.LoadLibrary(str(b.path))
        for symbol in handlers().values():
            getattr(library, symbol)
    except FileNotFoundError as e:
        raise KernelBuildError(f"no C++ compiler: {b.compiler!r} not found (set CXX)") from e
    except subprocess.CalledProcessError as e:
        raise KernelBuildError(f"the build failed ({shlex.join(b.command)}): "
                               f"{(e.stderr or '').strip()[-2000:]}") from e
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the library {b.path} did not load: {e}") from e
    return library


@functools.lru_cache(maxsize=None)
def load() -> str | None:
    """Build (once per sources, compiler and CPU), load and register the kernels, once per
    process: None when they are registered, else why they cannot be (logged once)."""
    try:
        library = build(plan())
    except KernelBuildError as e:
        log.warning("CPU kernels unavailable: decodes and verifies use the tuned XLA attention "
                    "path, the sampler its pure-JAX top-k/top-p, and the layers XLA's dots on "
                    "sliced weights: %s", e)
        return str(e).splitlines()[0][:200]
    for target, symbol in handlers().items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return None
