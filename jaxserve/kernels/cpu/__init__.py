"""The C++ CPU kernels (attention decodes, the sampler's thresholds, the layers' in-place
matmul): their sources and build (`library`), and the one switch every caller asks (`enabled`).

The switch is the environment variable JAXSERVE_CPU_KERNELS: `auto` (the default) uses the
kernels where JAX's default backend is the CPU and the library builds; `off` never builds or
calls them, and every caller takes its pure-JAX path (for an A/B, or an incident). The
`--cpu-kernels` flag of the commands that build an engine sets the same variable (`set_mode`).
Importing this module loads no JAX: the CLI reads the switch before it loads anything.
"""

from __future__ import annotations

import os

from jaxserve.errors import ConfigError

ENV = "JAXSERVE_CPU_KERNELS"
MODES = ("auto", "off")


def mode() -> str:
    """The switch's setting: `auto` unless JAXSERVE_CPU_KERNELS says otherwise."""
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ConfigError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def set_mode(value: str) -> None:
    """Set the switch for this process and those it starts (the --cpu-kernels flag)."""
    if value not in MODES:
        raise ConfigError(f"--cpu-kernels {value!r}: expected one of {', '.join(MODES)}")
    os.environ[ENV] = value


def why_off() -> str | None:
    """Why the kernels are not used in this process, or None when they are (the library is
    then built and registered: the first call builds it)."""
    if mode() == "off":
        return f"{ENV}=off"
    import jax

    if (backend := jax.default_backend()) != "cpu":
        return f"not on the CPU (JAX's backend is {backend})"
    from jaxserve.kernels.cpu import library

    return library.load()


def enabled() -> bool:
    """Whether the C++ CPU kernels are used: the one question every caller asks."""
    return why_off() is None
