"""A suite file (TOML): the tasks, the model versions to run them on (oldest first: each version is
compared with the one before it), where results go and when a drop is an alert.

    name = "nightly"
    store = "evals.sqlite"        # relative to this file, or a postgresql:// DSN
    seed = 1234
    limit = 1000                  # questions per task (optional: all)

    [[tasks]]
    name = "arc_easy"             # an lm-evaluation-harness task ...
    [[tasks]]
    path = "tasks/capitals.yaml"  # ... or a local task file (YAML + JSONL beside it), offline
    metric = "exact_match"        # optional: the task's first metric

    [[versions]]
    name = "v1"
    url = "http://127.0.0.1:8000/v1"   # a running server ...
    model = "smollm2-135m-instruct"
    via = "batch"                      # optional: its requests as OpenAI batches (default live)
    [[versions]]
    name = "v2"
    path = "models/v2.gguf"            # ... a model path (or registered name), run in-process
    engine = { max_model_len = 2048 }  #     with these engine settings
    [[versions]]
    name = "smol-v3"
    deployment = "deploy.toml"         # ... or that deployment file's version of this name

    [regression]
    min_drop_points = 1.0
    alpha = 0.05

Every key is checked: an unknown one is an error naming it, since a misspelt `alpha` silently
taking its default would change when alerts fire.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jaxserve.engine_settings import BY_NAME
from jaxserve.errors import InvalidRequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}$")
APIS = ("completions", "chat-completions")
VIAS = ("live", "batch")  # lm-eval's requests one by one on the route, or as OpenAI batches


@dataclass(frozen=True)
class TaskSpec:
    name: str  # the lm-eval task name (a local file's `task:` field)
    path: Path | None = None  # a local YAML task file
    metric: str | None = None
    num_fewshot: int | None = None



@dataclass(frozen=True)
class VersionSpec:
    """Where a version answers: a running server (`url`), or, started in-process for the run,
    a model (`path`, with `engine` settings) or a deployment file's version of this name."""

    name: str
    url: str | None  # a running server's OpenAI base URL (…/v1); None: served in-process
    model: str  # the `model` field sent (an in-process version: its name)
    api: str = "completions"
    manifest_id: str | None = None
    system_instruction: str | None = None
    api_key_env: str | None = None  # the name of an env var holding the key, never the key
    num_concurrent: int = 4
    batch_size: int = 1  # prompts per request (lm-eval sends a list as `prompt`)
    max_gen_toks: int = 256
    path: str | None = None  # a model path or registered name
    engine: tuple[tuple[str, Any], ...] = ()  # a `path` version's engine settings, sorted
    deployment: Path | None = None  # a deployment file holding [version.NAME]
    via: str = "live"  # one of VIAS

    @property
    def in_process(self) -> bool:
        return self.url is None

    def settings(self) -> dict:
        """What decides its results besides its id (a server's URL is in its default id; an
        in-process version's id is its manifest, which the engine settings do not all enter)."""
        source = ({} if self.url is not None else
                  {"path": self.path, "engine": dict(self.engine)} if self.path is not None else
                  {"deployment": str(self.deployment)})
        # `via` enters only when not live, so runs stored before it existed keep their keys.
        via = {} if self.via == "live" else {"via": self.via}
        return {"api": self.api, "system_instruction": self.system_instruction,
                "max_gen_toks": self.max_gen_toks, "batch_size": self.batch_size, **source,
                **via}


@dataclass(frozen=True)
class RegressionConfig:
    min_drop_points: float = 1.0  # percentage points
    alpha: float = 0.05
    bootstrap_samples: int = 10_000  # the paired bootstrap, for tasks scored other than 0/1
    webhook: str | None = None
    metrics_file: Path | None = None
    report_file: Path | None = None


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    store: str
    tasks: tuple[TaskSpec, ...]
    versions: tuple[VersionSpec, ...]
    seed: int = 1234
    limit: int | None = None
    regression: RegressionConfig = field(default_factory=RegressionConfig)


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise InvalidRequest(f"{where}: unknown key(s) {', '.join(unknown)}")


def _typed(table: dict, key: str, kind, where: str, default=None):
    value = table.get(key, default)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                              and kind is not bool):
        raise InvalidRequest(f"{where}.{key}: want {getattr(kind, '__name__', kind)}, "
                             f"got {value!r}")
    return value


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidRequest(f"{where}: want a name of letters, digits and _.:@/- "
                             f"(at most 128), got {value!r}")
    return value


def _task(table: dict, base: Path, i: int) -> TaskSpec:
    where = f"tasks[{i}]"
    if not isinstance(table, dict):
        raise InvalidRequest(f"{where}: want a table")
    _check_keys(table, {"name", "path", "metric", "num_fewshot"}, where)
    if ("name" in table) == ("path" in table):
        raise InvalidRequest(f"{where}: give exactly one of name (an lm-eval task) or path "
                             "(a local task file)")
    path = None
    if "path" in table:
        path = (base / _typed(table, "path", str, where)).resolve()
        if not path.is_file():
            raise InvalidRequest(f"{where}.path: no file {path}")
        name = _local_task_name(path, where)
    else:
        name = _name(table["name"], f"{where}.name")
    shots = _typed(table, "num_fewshot", int, where)
    if shots is not None and not 0 <= shots <= 64:
        raise InvalidRequest(f"{where}.num_fewshot: want 0..64, got {shots}")
    metric = _typed(table, "metric", str, where)
    return TaskSpec(name, path, metric and _name(metric, f"{where}.metric"), shots)


def _local_task_name(path: Path, where: str) -> str:
    match = re.search(r"^task:\s*['\"]?([^'\"\s#]+)", path.read_text(), re.MULTILINE)
    if not match:
        raise InvalidRequest(f"{where}.path: {path.name} has no top-level `task:` name")
    return _name(match.group(1), f"{where}.path task")


_SOURCES = ("url", "path", "deployment")


def _source(table: dict, base: Path, where: str) -> dict:
    """The version's one source: url (with the model it serves), or path (with engine settings,
    checked by name here and by value when the engine is built), or deployment."""
    given = [key for key in _SOURCES if key in table]
    if len(given) != 1:
        raise InvalidRequest(f"{where}: give exactly one of url (a running server), path (a "
                             "model, run in-process) or deployment (a deployment file's "
                             "version of this name, run in-process)")
    if "engine" in table and "path" not in table:
        raise InvalidRequest(f"{where}.engine: only with path (a deployment's version has its "
                             "own settings; a server has its own)")
    if "url" in table:
        if "model" not in table:
            raise InvalidRequest(f"{where}.model: required with url")
        url = _typed(table, "url", str, where).rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidRequest(f"{where}.url: want an http(s) base URL such as "
                                 f"http://host:8000/v1, got {url!r}")
        return {"url": url, "model": _name(table["model"], f"{where}.model")}
    if "model" in table:
        raise InvalidRequest(f"{where}.model: only with url (an in-process version is "
                             "addressed by its name)")
    name = _name(table.get("name"), f"{where}.name")
    if "deployment" in table:
        path = (base / _typed(table, "deployment", str, where)).resolve()
        if not path.is_file():
            raise InvalidRequest(f"{where}.deployment: no file {path}")
        return {"url": None, "model": name, "deployment": path}
    model = _typed(table, "path", str, where)
    if not model or len(model) > 4096:
        raise InvalidRequest(f"{where}.path: want a model path or a registered model name")
    # A relative path is the suite's; a registered name (no such file) stays as written.
    local = base / model
    engine = _typed(table, "engine", dict, where, {})
    unknown = sorted(set(engine) - set(BY_NAME))
    if unknown:
        raise InvalidRequest(f"{where}.engine: unknown setting(s) {', '.join(unknown)}")
    return {"url": None, "model": name, "path": str(local.resolve()) if local.exists() else model,
            "engine": tuple(sorted(engine.items()))}


def _version(table: dict, base: Path, i: int) -> VersionSpec:
    where = f"versions[{i}]"
    if not isinstance(table, dict):
        raise InvalidRequest(f"{where}: want a table")
    _check_keys(table, {"name", "model", "api", "manifest_id", "system_instruction",
                        "api_key_env", "num_concurrent", "batch_size", "max_gen_toks", "engine",
                        "via", *_SOURCES}, where)
    if "name" not in table:
        raise InvalidRequest(f"{where}.name: required")
    source = _source(table, base, where)
    api = _typed(table, "api", str, where, "completions")
    if api not in APIS:
        raise InvalidRequest(f"{where}.api: want one of {', '.join(APIS)}, got {api!r}")
    concurrent = _typed(table, "num_concurrent", int, where, 4)
    if not 1 <= concurrent <= 256:
        raise InvalidRequest(f"{where}.num_concurrent: want 1..256, got {concurrent}")
    batch = _typed(table, "batch_size", int, where, 1)
    if not 1 <= batch <= 256:
        raise InvalidRequest(f"{where}.batch_size: want 1..256, got {batch}")
    gen = _typed(table, "max_gen_toks", int, where, 256)
    if not 1 <= gen <= 32768:
        raise InvalidRequest(f"{where}.max_gen_toks: want 1..32768, got {gen}")
    via = _typed(table, "via", str, where, "live")
    if via not in VIAS:
        raise InvalidRequest(f"{where}.via: want one of {', '.join(VIAS)}, got {via!r}")
    if via == "batch" and source["url"] is None:
        raise InvalidRequest(f"{where}.via: \"batch\" needs url (a running server whose batches "
                             "outlive the run, so a re-run can resume them)")
    manifest = _typed(table, "manifest_id", str, where)
    return VersionSpec(
        name=_name(table["name"], f"{where}.name"), api=api,
        manifest_id=manifest and _name(manifest, f"{where}.manifest_id"),
        system_instruction=_typed(table, "system_instruction", str, where),
        api_key_env=_typed(table, "api_key_env", str, where), num_concurrent=concurrent,
        batch_size=batch, max_gen_toks=gen, via=via, **source)


def _regression(table: dict, base: Path) -> RegressionConfig:
    where = "regression"
    if not isinstance(table, dict):
        raise InvalidRequest(f"{where}: want a table")
    _check_keys(table, {"min_drop_points", "alpha", "bootstrap_samples", "webhook",
                        "metrics_file", "report_file"}, where)
    drop = float(_typed(table, "min_drop_points", (int, float), where, 1.0))
    alpha = float(_typed(table, "alpha", (int, float), where, 0.05))
    boot = _typed(table, "bootstrap_samples", int, where, 10_000)
    if not 0 <= drop <= 100:
        raise InvalidRequest(f"{where}.min_drop_points: want 0..100, got {drop}")
    if not 0 < alpha < 1:
        raise InvalidRequest(f"{where}.alpha: want a level in (0, 1), got {alpha}")
    if not 100 <= boot <= 1_000_000:
        raise InvalidRequest(f"{where}.bootstrap_samples: want 100..1000000, got {boot}")
    webhook = _typed(table, "webhook", str, where)
    if webhook is not None and urlsplit(webhook).scheme not in ("http", "https"):
        raise InvalidRequest(f"{where}.webhook: want an http(s) URL, got {webhook!r}")
    files = {k: (base / v) if (v := _typed(table, k, str, where)) else None
             for k in ("metrics_file", "report_file")}
    return RegressionConfig(drop, alpha, boot, webhook, **files)


def load_suite(path: str | Path) -> Suite:
    path = Path(path).resolve()
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise InvalidRequest(f"suite: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidRequest(f"suite {path.name}: not TOML: {e}") from None
    _check_keys(doc, {"name", "store", "seed", "limit", "tasks", "versions", "regression"},
                "suite")
    base = path.parent
    tasks, versions = doc.get("tasks", []), doc.get("versions", [])
    if not isinstance(tasks, list) or not tasks or len(tasks) > 256:
        raise InvalidRequest("suite.tasks: want 1..256 [[tasks]] tables")
    if not isinstance(versions, list) or not versions or len(versions) > 64:
        raise InvalidRequest("suite.versions: want 1..64 [[versions]] tables")
    task_specs = tuple(_task(t, base, i) for i, t in enumerate(tasks))
    version_specs = tuple(_version(v, base, i) for i, v in enumerate(versions))
    for what, names in (("tasks", [t.name for t in task_specs]),
                        ("versions", [v.name for v in version_specs])):
        if len(set(names)) != len(names):
            raise InvalidRequest(f"suite.{what}: names repeat: {names}")
    seed = _typed(doc, "seed", int, "suite", 1234)
    limit = _typed(doc, "limit", int, "suite")
    if limit is not None and not 1 <= limit <= 1_000_000:
        raise InvalidRequest(f"suite.limit: want 1..1000000, got {limit}")
    return Suite(
        name=_name(doc.get("name", path.stem), "suite.name"), path=path,
        store=_typed(doc, "store", str, "suite", "evals.sqlite"), tasks=task_specs,
        versions=version_specs, seed=seed, limit=limit,
        regression=_regression(doc.get("regression", {}), base))
