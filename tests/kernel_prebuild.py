"""The CPU kernel library's older-x86 builds (test_cpu_kernels' test of them), started when the
session's tests are collected and awaited by that test: each is a g++ run of ~30 s on one core,
and the suite's mostly single-threaded run leaves the second core idle much of the time. The
child is niced, so the tests running meanwhile keep their core. Importing this starts nothing
(conftest's collection hook does)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# AVX2 without AVX-VNNI too (a host of the AVX2 generation: the GGUF kernel's pmaddubsw path), and
# the compiler's generic vectors.
OLDER_X86_FLAGS = ("-mno-avx512f -mno-avxvnni", "-mno-avx512f -mno-avx2")
TEST = "test_cpu_kernels_built_for_older_x86_match_their_references"
ROOT = Path(__file__).resolve().parents[1]

# One child builds each variant in turn (two at once would take both cores), through the
# library's own build: the test's run then finds it under the same key, or builds it itself if
# the sources changed meanwhile. A failed build is left for the test to make and report.
_BUILD = """
import os, sys
from jaxserve.kernels.cpu import library
from tests.kernel_prebuild import older_x86_env
# Each from the environment as it came (older_x86_env appends the flags to $CXX).
for env in [older_x86_env(f, c) for f, c in zip(sys.argv[1::2], sys.argv[2::2])]:
    os.environ.update(env)
    try:
        library.build(library.plan())
    except library.KernelBuildError:
        pass
"""


def older_x86_env(flags: str, cache: Path) -> dict[str, str]:
    """The environment that builds and loads the library for `flags` from `cache`."""
    return {**os.environ, "CXX": f"{os.environ.get('CXX', 'g++')} {flags}",
            "JAXSERVE_CACHE": str(cache)}


def wanted(items) -> bool:
    return (platform.machine() in ("x86_64", "AMD64")
            and any(getattr(item, "originalname", None) == TEST for item in items))


class Prebuild:
    """The background builds, one kernel cache per variant."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="jaxserve-older-x86-"))
        args = [a for flags in OLDER_X86_FLAGS for a in (flags, str(self.cache(flags)))]
        self.proc = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", _BUILD, *args],
                                     cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def cache(self, flags: str) -> Path:
        return self.root / flags.replace(" ", "_")

    def wait(self, flags: str) -> Path:
        """`flags`' kernel cache, once the child has stopped building."""
        self.proc.wait(timeout=600)
        return self.cache(flags)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
