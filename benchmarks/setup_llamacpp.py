"""Build llama.cpp's `llama-server` from source for `benchmarks/serving.py --compare llamacpp`.

The source is the llama.cpp tree that ships inside the `llama-cpp-python` sdist on PyPI (fetched
with `pip download --no-binary :all: --no-deps`, so nothing is installed and no binary is
downloaded); it is built with CMake for the host CPU (GGML_NATIVE: AVX2/AVX-512 as the host has)
and cached outside the repository, in `~/.cache/jaxserve/llamacpp/<version>/` (or
`$JAXSERVE_CACHE/llamacpp/...`). A second run finds the binary and builds nothing.

Some virtual machines report AMX in cpuid but fault on its instructions (`tilezero`: SIGILL), and
GGML_NATIVE's `-march=native` turns AMX on from cpuid; so where the host claims AMX, a ten-line
probe runs one tile instruction first and the build leaves AMX out when the probe dies.

    python benchmarks/setup_llamacpp.py            # prints the path of llama-server
    python benchmarks/setup_llamacpp.py --version 0.3.36
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built


def cache_dir() -> Path:
    root = os.environ.get("JAXSERVE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "jaxserve") / "llamacpp"


AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def amx_runs(workdir: Path) -> bool:
    """Whether this host executes AMX tile instructions (False where cpuid has no amx_tile)."""
    try:
        if "amx_tile" not in Path("/proc/cpuinfo").read_text():
            return False
    except OSError:
        return False
    src, exe = workdir / "amx_probe.c", workdir / "amx_probe"
    src.write_text(AMX_PROBE)
    built = subprocess.run(["cc", "-O1", "-mamx-tile", str(src), "-o", str(exe)],
                           capture_output=True)
    return built.returncode == 0 and subprocess.run([str(exe)]).returncode == 0


def llama_server(version: str = DEFAULT_VERSION, jobs: int | None = None) -> Path:
    """The path of a built llama-server, building it first if it is not cached."""
    base = cache_dir() / version
    binary = base / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    base.mkdir(parents=True, exist_ok=True)
    sdist = base / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={version}", "-d", str(base)],
                       check=True)
    source = base / "llama.cpp"
    if not source.exists():
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name],
                           filter="data")
    build = base / "build"
    flags = []
    if not amx_runs(base):
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags = [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j",
                    str(jobs or os.cpu_count() or 1)], check=True)
    if not binary.exists():
        raise FileNotFoundError(f"the build did not produce {binary}")
    return binary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default=DEFAULT_VERSION)
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args()
    print(llama_server(args.version, args.jobs))


if __name__ == "__main__":
    main()
