"""`jaxserve kernels build | status`, and the `--cpu-kernels` flag of the commands that build an
engine: the C++ CPU kernels' switch (jaxserve.kernels.cpu) and library
(jaxserve.kernels.cpu.library) from the command line."""

from __future__ import annotations

import argparse
import os
import subprocess

from jaxserve.kernels import cpu


def add_cpu_kernels_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-kernels", choices=cpu.MODES, default=None,
                        help=f"the C++ CPU kernels (attention decodes, sampler thresholds, "
                             f"in-place matmul): auto uses them on the CPU where they build, off "
                             f"takes the pure-JAX paths; sets {cpu.ENV} (default: its value, "
                             f"else auto)")


def configure_cpu_kernels(args: argparse.Namespace) -> None:
    """Apply --cpu-kernels, then read the switch once so a bad JAXSERVE_CPU_KERNELS fails before
    anything loads."""
    if args.cpu_kernels is not None:
        cpu.set_mode(args.cpu_kernels)
    cpu.mode()


def cmd_build(args) -> int:
    from jaxserve.kernels.cpu import library

    b = library.plan()
    library.build(b)  # a KernelBuildError is printed as one line, exit status 1
    print(f"built {b.path} ({len(library.handlers())} kernels, key {b.key})")
    return 0


def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "not found (set CXX)"
    return (out.stdout.splitlines() or ["unknown version"])[0]


def status_lines() -> list[str]:
    """What is built (library, sources' key, compiler) and what this process would use now.
    Builds nothing: with the library not built yet, says so instead of building it."""
    import jax

    from jaxserve.kernels import paths
    from jaxserve.kernels.cpu import library

    b = library.plan()
    built = b.path.exists()
    setting = os.environ.get(cpu.ENV)
    lines = [
        f"switch: {cpu.mode()} ({cpu.ENV} unset)" if setting is None
        else f"switch: {cpu.mode()} ({cpu.ENV}={setting})",
        f"library: {b.path} ({'built' if built else 'not built'})",
        f"sources: {', '.join(p.name for p in library.sources())} "
        f"(+ {', '.join(p.name for p in library.headers())}); key {b.key}",
        f"FFI targets: {', '.join(sorted(library.handlers()))}",
        f"compiler: {b.compiler} ({_compiler_version(b.compiler)})",
    ]
    if built or cpu.mode() == "off" or jax.default_backend() != "cpu":
        lines.append(f"now: {paths.summary()}")
    else:
        lines.append("now: the library is not built yet; the first engine builds it (or "
                     "`jaxserve kernels build`), then uses the CPU kernels if it builds")
    return lines


def cmd_status(args) -> int:
    print("\n".join(status_lines()))
    return 0


def add_kernels_command(sub) -> None:
    k = sub.add_parser("kernels", help="the C++ CPU kernels: build them ahead of time, or say "
                                       "what is built and used")
    commands = k.add_subparsers(dest="kernels_command", required=True)
    b = commands.add_parser("build", help="compile the CPU kernels' library for this host and "
                                          "compiler into the kernel cache (for images); exit 1 "
                                          "if it cannot")
    b.set_defaults(func=cmd_build)
    s = commands.add_parser("status", help="the library's path, sources' key and compiler, "
                                           "and which kernel paths would be used now")
    s.set_defaults(func=cmd_status)
