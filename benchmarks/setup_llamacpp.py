"""Build llama.cpp's `llama-server` from source for `benchmarks/serving.py --compare llamacpp`.

The source is the llama.cpp tree that ships inside the `llama-cpp-python` sdist on PyPI (fetched
with `pip download --no-binary :all: --no-deps`, so nothing is installed and no binary is
downloaded); it is built with CMake for the host CPU (GGML_NATIVE: AVX2/AVX-512 as the host has)
and cached outside the repository, in `~/.cache/jaxserve/llamacpp/<version>/` (or
`$JAXSERVE_CACHE/llamacpp/...`). A second run finds the binary and builds nothing.

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
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
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
