"""Version manifests: everything that decides a version's answers, content-addressed.

A manifest pins the sha256 of every weight file (each file of an orbax checkpoint), of the
tokenizer's files and of the chat template, the generation defaults, the engine settings that
change outputs (dtype, KV cache dtype, max_model_len) and the price. Its id, `fp_` + 16 hex
digits, hashes all of that but no path: the same bytes served from another directory are the same
version, and one changed byte or setting is another. Responses carry the id as OpenAI's
`system_fingerprint`.

Hashing gigabytes takes a while, so digests are cached by (path, size, mtime) in the jaxserve
cache: a restart re-hashes only files that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.model_registry import ModelSpec, cache_dir, resolve, sha256_of
from jaxserve.gateway.pricing import Pricing, pricing_for

_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class FileHashCache:
    """sha256 of files, remembered by (path, size, mtime_ns) in a JSON file."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir().parent / "file-hashes.json"
        self._lock = threading.Lock()
        try:
            self._entries: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._entries = {}

    def sha256(self, file: Path) -> str:
        file = Path(file).resolve()
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        with self._lock:
            entry = self._entries.get(str(file))
        if entry is not None and entry[:2] == stamp:
            return entry[2]
        digest = sha256_of(file)
        with self._lock:
            self._entries[str(file)] = [*stamp, digest]
            self._save()
        return digest

    def _save(self) -> None:
        # Written whole and renamed into place: a reader (another process) never sees half.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".file-hashes.")
            with os.fdopen(fd, "w") as f:
                json.dump(self._entries, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache only costs re-hashing next time


@dataclass(frozen=True)
class ResolvedVersion:
    """A VersionSpec with its model found and its settings checked (nothing loaded yet)."""

    spec: VersionSpec
    model: ModelSpec
    engine_config: EngineConfig
    pricing: Pricing | None

    @property
    def engine_settings(self) -> dict:
        """The settings that change outputs, as they will be (defaults filled in)."""
        c = self.engine_config
        return {"dtype": c.model.dtype, "kv_cache_dtype": c.cache.dtype or c.model.dtype,
                "max_model_len": c.scheduler.max_model_len}


def resolve_version(spec: VersionSpec) -> ResolvedVersion:
    """Find the model and check every setting against it (ModelNotFound, or InvalidRequest naming
    the field), reading only metadata."""
    from jaxserve.engine_settings import make_engine_config
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.weights import read_config

    model = resolve(spec.model)
    config = read_config(model, spec.dtype)
    try:
        engine_config = make_engine_config(config, {**model.engine_defaults,
                                                    **dict(spec.engine_args)})
    except InvalidRequest as e:
        raise InvalidRequest(f"version {spec.name}: {e}", param=e.param) from None
    except ConfigError as e:
        raise InvalidRequest(f"version {spec.name}: {e}") from None
    sampling = {k: list(v) if k == "stop" else v for k, v in spec.generation
                if k != "system_prompt"}
    try:
        SamplingParams(**sampling)
    except InvalidRequest as e:
        raise InvalidRequest(f"version {spec.name}: generation: {e}",
                             param=f"generation.{e.param}") from None
    return ResolvedVersion(spec, model, engine_config,
                           spec.pricing if spec.pricing is not None else pricing_for(spec.model))


@dataclass(frozen=True)
class Manifest:
    id: str
    body: dict  # everything but the id, as printed

    def to_dict(self) -> dict:
        return {"id": self.id, **self.body}


def _weight_files(model: ModelSpec) -> list[Path]:
    if model.format == "gguf":
        return [model.path]
    if model.format == "hf":  # what the loader reads
        return sorted(p for p in model.path.iterdir()
                      if p.name in ("config.json", "model.safetensors.index.json")
                      or p.suffix == ".safetensors")
    return sorted(p for p in model.path.rglob("*") if p.is_file())  # orbax: every file


def _tokenizer_files(model: ModelSpec) -> list[Path]:
    from jaxserve.tokenizer import tokenizer_source

    source = tokenizer_source(model)
    if source is None:
        return []
    source = Path(source)
    side = [] if source.suffix == ".gguf" else [source.parent / n for n in _TOKENIZER_SIDE_FILES]
    return [source, *(p for p in side if p.exists())]


def build_manifest(resolved: ResolvedVersion, chat_template: str | None,
                   hashes: FileHashCache) -> Manifest:
    model = resolved.model
    root = model.path if model.path.is_dir() else None
    weights = [{"path": str(p.relative_to(root)) if root else p.name, "sha256": hashes.sha256(p),
                "bytes": p.stat().st_size} for p in _weight_files(model)]
    tokenizer = {"files": [{"path": p.name, "sha256": hashes.sha256(p)}
                           for p in _tokenizer_files(model)],
                 "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest()
                 if chat_template is not None else None}
    body = {"model": resolved.spec.model, "format": model.format, "weights": weights,
            "tokenizer": tokenizer,
            "generation": {k: list(v) if k == "stop" else v for k, v in resolved.spec.generation},
            "engine": resolved.engine_settings,
            "pricing": resolved.pricing.to_dict() if resolved.pricing is not None
            else None}
    # What the id covers: contents, not where they are (a single file's name is left out; a
    # directory's layout is part of the checkpoint).
    material = {**body, "model": None,
                "weights": [[w["path"] if root else "", w["sha256"]] for w in weights],
                "tokenizer": {**tokenizer, "files": [f["sha256"] for f in tokenizer["files"]]}}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode())
    return Manifest("fp_" + digest.hexdigest()[:16], body)


def manifest_of(spec: VersionSpec, hashes: FileHashCache | None = None) -> Manifest:
    """The manifest of a version without loading its weights (`jaxserve manifest`)."""
    from jaxserve.tokenizer import load_tokenizer

    resolved = resolve_version(spec)
    return build_manifest(resolved, load_tokenizer(resolved.model).chat_template,
                          hashes or FileHashCache())
