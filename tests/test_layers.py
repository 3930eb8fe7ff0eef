"""The package's layers (DESIGN.md, "Imports flow one way"), walked from the code's own imports.

Every `import` and `from ... import` of a jaxserve module is read, at module level and inside
functions alike. An import may go down the table below or stay inside its own package; one that
goes up, or sideways into another package of the same layer, is an error, and so is any circle of
modules. Host-side packages import no JAX: not directly, and not by importing them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jaxserve"

# Top to bottom: a module may import from a lower layer. Packages on one line are siblings and do
# not import each other. A name is a package or module under jaxserve/ (the longest prefix wins).
LAYERS = (
    ("entrypoints",),  # cli, launcher, batch, grpc, LLM: they wire the layers below together
    ("entrypoints.http",),  # the aiohttp app and its routes
    ("entrypoints.serving",),  # the request path every transport shares, no I/O of its own
    ("fleet", "agents", "evals", "batches", "disagg"),
    ("gateway",),
    ("core", "rag"),
    ("tokenizer",),
    ("weights",),
    ("executor",),
    ("kernels",),
    ("tool_calling", "audit"),
    ("structured", "safety", "telemetry", "reasoning"),
    ("engine_settings",),  # the engine settings table: flags, deployment fields, EngineConfig
    ("model_registry", "config", "protos", "shapes", "sqlite_store", "gguf_file"),
    ("errors",),
)
# Host side: scheduling, bookkeeping and request handling, tested without a device.
HOST_SIDE = ("core", "gateway", "fleet", "agents", "evals", "batches", "disagg",
             "entrypoints.serving",
             "tokenizer", "model_registry", "engine_settings", "config", "shapes", "errors",
             "structured", "tool_calling", "reasoning", "safety", "audit", "telemetry",
             "sqlite_store", "gguf_file")
DEVICE_LIBRARIES = ("jax", "jaxlib", "flax", "orbax")
# The package's face (lazy `jaxserve.LLM`) and `python -m jaxserve` stand above every layer.
FACES = ("jaxserve", "jaxserve.__main__")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """(jaxserve modules, third-party top-level names) that `name` imports anywhere in its body."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import module` names the module itself
                full = f"{base}.{a.name}"
                found.add(full if full in MODULES else base)
    return found


def _owner(module: str) -> str:
    """The module's own name if it is one, else the module that defines the imported name."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def _layer(module: str) -> tuple[int, str] | None:
    rel = module.removeprefix("jaxserve.")
    best = None
    for level, group in enumerate(LAYERS):
        for unit in group:
            if (rel == unit or rel.startswith(unit + ".")) and (
                    best is None or len(unit) > len(best[1])):
                best = (level, unit)
    return best


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {_owner(m) for m in _imports(name, path)
                       if m.split(".")[0] == "jaxserve"} - {name, ""}
    return graph


GRAPH = _graph()


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m not in FACES and _layer(m) is None)
    assert not missing, f"modules outside every layer of LAYERS: {missing}"


def test_imports_go_down_the_layers():
    bad = []
    for name, targets in sorted(GRAPH.items()):
        if name in FACES:
            continue
        level, unit = _layer(name)
        for target in sorted(targets):
            t_level, t_unit = _layer(target)
            if t_unit == unit or t_level > level:
                continue
            way = "up" if t_level < level else "sideways"
            bad.append(f"{name} ({unit}) imports {target} ({t_unit}): {way}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    circles = _cycles(GRAPH)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _host_side(module: str) -> bool:
    rel = module.removeprefix("jaxserve.")
    return any(rel == u or rel.startswith(u + ".") for u in HOST_SIDE)


def test_host_side_code_names_no_device_library():
    bad = sorted(f"{name} imports {lib}" for name, path in MODULES.items() if _host_side(name)
                 for lib in _imports(name, path)
                 if lib.split(".")[0] in DEVICE_LIBRARIES)
    assert not bad, "host-side modules that import JAX themselves:\n" + "\n".join(bad)


def test_host_side_modules_load_without_jax():
    host = sorted(m for m in MODULES if _host_side(m))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in host) +
            "loaded = sorted(k for k in sys.modules if k.split('.')[0] in "
            f"{DEVICE_LIBRARIES!r})\nprint(' '.join(loaded[:5]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the host side loads: {out.stdout.strip()}"


@pytest.mark.parametrize("source, expected", [
    ("from jaxserve.core import engine\n", {"jaxserve.core.engine"}),
    ("def f():\n    from jaxserve.executor.runner import ModelRunner\n",
     {"jaxserve.executor.runner"}),
    ("import jax.numpy as jnp\n", {"jax.numpy"}),
])
def test_the_walker_reads_imports_at_every_depth(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _imports("jaxserve.x.m", path) == expected
