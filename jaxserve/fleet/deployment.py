"""The deployment file (TOML): versions, each a model with its engine settings, and routes between
them. The same checks read the admin API's JSON bodies.

    [version.smol-v1]
    model = "smollm2-135m-instruct"
    kv_cache_memory_fraction = 0.4
    [route.smollm2]
    weights = { smol-v1 = 90, smol-v2 = 10 }
    sticky = "user"
    shadow = { smol-v2 = 0.2 }

A bad value is an InvalidRequest whose `param` is the dotted field (`route.smollm2.sticky`);
`load_deployment` turns it into one ConfigError naming the file and the field. Host-side: no JAX
(sampling values are range-checked when the fleet prepares the version).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from jaxserve.engine_settings import BY_NAME
from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.fleet.breaker import BreakerConfig
from jaxserve.fleet.degrade import DEGRADABLE, DegradeConfig
from jaxserve.fleet.routing import STICKY_MODES, CanaryGate, Route
from jaxserve.gateway.pricing import Pricing, parse_pricing
from jaxserve.model_registry import cache_dir, registry

# Names travel in URLs (/admin/v1/versions/{name}) and as the OpenAI `model` field.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# Request defaults a version may set: the OpenAI sampling fields, and a system prompt for chats
# that bring none.
GENERATION_FIELDS = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
    "max_tokens": int, "seed": int, "stop": list, "system_prompt": str,
}
# A version's engine settings are those of jaxserve.engine_settings, by name.
_VERSION_FIELDS = {"model", "generation", "pricing", *BY_NAME}
_ROUTE_FIELDS = {"weights", "sticky", "shadow", "canary", "breaker", "gate", "degrade"}
_DEGRADE_FIELDS = {"classes", "max_tokens", "degrade_to", "queue_fraction", "kv_usage"}
_BREAKER_FIELDS = {"max_error_rate", "min_requests", "window_seconds", "open_seconds"}
_CANARY_FIELDS = {"incumbent", "window_seconds", "min_requests", "max_error_rate_ratio",
                  "min_error_rate", "max_ttft_p99_ratio", "max_cost_ratio",
                  "availability_objective", "max_burn_rate"}


@dataclass(frozen=True)
class VersionSpec:
    """What a version is made of, as asked for (before the model is resolved)."""

    name: str
    model: str
    dtype: str | None = None
    engine_args: tuple[tuple[str, Any], ...] = ()  # sorted (flag, value)
    generation: tuple[tuple[str, Any], ...] = ()  # sorted (field, value)
    pricing: Pricing | None = None  # None: the model config's [pricing], if any

    @classmethod
    def of(cls, name: str, model: str, settings: dict, **kwargs: Any) -> "VersionSpec":
        """A version from engine settings by name (dtype among them)."""
        settings = dict(settings)
        return cls(name, model, settings.pop("dtype", None), tuple(sorted(settings.items())),
                   **kwargs)

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "dtype": self.dtype,
                **dict(self.engine_args), "generation": dict(self.generation),
                "pricing": self.pricing.to_dict() if self.pricing is not None else None}


@dataclass(frozen=True)
class Deployment:
    versions: tuple[VersionSpec, ...]
    routes: tuple[Route, ...]


# ---------------------------------------------------------------- values


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"'{field}' {message}", param=field)


def _table(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(field, f"must be a table (object), got {type(value).__name__}")
    return value


def _unknown(table: dict, allowed: set, prefix: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _bad(f"{prefix}{unknown[0]}",
                   f"is not a known field (known: {', '.join(sorted(allowed))})")


def _number(value: Any, field: str, *, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(field, f"must be a number, got {type(value).__name__} {value!r:.40}")
    if not lo <= value <= hi:
        raise _bad(field, f"must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


def _typed(value: Any, kind: type, field: str) -> Any:
    if kind is float:
        return _number(value, field)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(field, f"must be an integer, got {type(value).__name__} {value!r:.40}")
    if kind is list and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise _bad(field, "must be a list of strings")
    if kind in (bool, str) and not isinstance(value, kind):
        raise _bad(field, f"must be a {kind.__name__}, got {type(value).__name__} {value!r:.40}")
    return tuple(value) if kind is list else value


def _setting(name: str, value: Any, field: str) -> Any:
    setting = BY_NAME[name]
    if setting.choices is not None:
        if value not in setting.choices:
            raise _bad(field, f"must be one of {', '.join(setting.choices)}, got {value!r:.40}")
        return value
    return _typed(value, setting.type, field)


def check_name(name: Any, field: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(field, f"must be 1-128 letters, digits or . _ : - (starting with a letter or "
                          f"digit), got {name!r:.60}")
    return name


def _shares(value: Any, field: str, hi: float) -> tuple[tuple[str, float], ...]:
    table = _table(value, field)
    return tuple(sorted((check_name(v, f"{field}.{v}"), _number(w, f"{field}.{v}", lo=0, hi=hi))
                        for v, w in table.items()))


# ---------------------------------------------------------------- versions


def parse_version(name: str, table: Any, prefix: str = "") -> VersionSpec:
    """A version from its table (file) or body (admin API, where `name` is in the body too);
    `prefix` is what field names are reported under (`version.NAME.`)."""
    table = _table(table, prefix.rstrip(".") or "body")
    _unknown(table, _VERSION_FIELDS, prefix)
    check_name(name, f"{prefix}name" if not prefix else prefix.rstrip("."))
    model = table.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(f"{prefix}model", "is required: a registered model name or a path")
    settings = {k: _setting(k, v, f"{prefix}{k}") for k, v in table.items() if k in BY_NAME}
    generation = _table(table.get("generation", {}), f"{prefix}generation")
    _unknown(generation, set(GENERATION_FIELDS), f"{prefix}generation.")
    generation = tuple(sorted((k, _typed(v, GENERATION_FIELDS[k], f"{prefix}generation.{k}"))
                              for k, v in generation.items()))
    pricing = None
    if "pricing" in table:
        try:
            pricing = parse_pricing(_table(table["pricing"], f"{prefix}pricing"),
                                    f"{prefix}pricing")
        except ConfigError as e:
            raise InvalidRequest(str(e), param=f"{prefix}pricing") from None
    return VersionSpec.of(name, model, settings, generation=generation, pricing=pricing)


def confine_admin_paths(spec: VersionSpec, model_roots: Sequence[Path] | None) -> None:
    """What the admin API may name (review a70e490, M4): a registered model, or a path whose
    real location (symlinks and `..` resolved) is under one of `model_roots`; and a chat
    template only as its text, never a file (a file's text would come back through /tokenize
    and /detokenize). InvalidRequest otherwise, saying nothing of whether the path exists."""
    template = dict(spec.engine_args).get("chat_template")
    if template is not None and ("{{" not in template and "{%" not in template
                                 or Path(template).is_file()):
        raise _bad("chat_template", "through the admin API is the template's text (jinja), not "
                                    "a path")
    if spec.model in registry():
        return
    if model_roots is None:  # the default: the model cache only
        model_roots = (cache_dir(),)
    real = Path(spec.model).expanduser().resolve()
    if not any(real.is_relative_to(Path(root).expanduser().resolve()) for root in model_roots):
        raise _bad("model", "is neither a registered model nor a path under the server's admin "
                            "model roots (serve --admin-model-root DIR)")


# ---------------------------------------------------------------- routes


def _parse_canary(value: Any, field: str, weights: dict[str, float]) -> CanaryGate:
    table = _table(value, field)
    _unknown(table, _CANARY_FIELDS, f"{field}.")
    incumbent = table.get("incumbent")
    if incumbent is None:  # the version most of the traffic goes to
        incumbent = max(sorted(weights), key=lambda v: weights[v]) if weights else None
    if incumbent not in weights or weights[incumbent] <= 0:
        raise _bad(f"{field}.incumbent", f"must name a version with a positive weight in this "
                                         f"route, got {incumbent!r:.60}")
    values: dict[str, Any] = {}
    if "window_seconds" in table:
        values["window_seconds"] = _number(table["window_seconds"], f"{field}.window_seconds",
                                           lo=1e-3)
    for k in ("max_error_rate_ratio", "max_ttft_p99_ratio", "max_cost_ratio"):
        if k in table:  # false turns the criterion off
            values[k] = None if table[k] is False else _number(table[k], f"{field}.{k}", lo=1)
    if "availability_objective" in table:
        values["availability_objective"] = _number(
            table["availability_objective"], f"{field}.availability_objective", lo=0, hi=1)
        if not 0 < values["availability_objective"] < 1:
            raise _bad(f"{field}.availability_objective", "must be a fraction in (0, 1)")
    if "max_burn_rate" in table:
        values["max_burn_rate"] = _number(table["max_burn_rate"], f"{field}.max_burn_rate", lo=1)
    if "min_error_rate" in table:
        values["min_error_rate"] = _number(table["min_error_rate"], f"{field}.min_error_rate",
                                           lo=0, hi=1)
    if "min_requests" in table:
        values["min_requests"] = _typed(table["min_requests"], int, f"{field}.min_requests")
        if values["min_requests"] < 1:
            raise _bad(f"{field}.min_requests", "must be >= 1")
    return CanaryGate(incumbent=incumbent, **values)


def _parse_breaker(value: Any, field: str) -> BreakerConfig:
    table = _table(value, field)
    _unknown(table, _BREAKER_FIELDS, f"{field}.")
    values: dict[str, Any] = {}
    if "max_error_rate" in table:
        values["max_error_rate"] = _number(table["max_error_rate"], f"{field}.max_error_rate",
                                           lo=0, hi=1)
    for k in ("window_seconds", "open_seconds"):
        if k in table:
            values[k] = _number(table[k], f"{field}.{k}", lo=1e-3, hi=86400)
    if "min_requests" in table:
        values["min_requests"] = _typed(table["min_requests"], int, f"{field}.min_requests")
        if values["min_requests"] < 1:
            raise _bad(f"{field}.min_requests", "must be >= 1")
    return BreakerConfig(**values)


def _parse_degrade(value: Any, field: str) -> DegradeConfig:
    table = _table(value, field)
    _unknown(table, _DEGRADE_FIELDS, f"{field}.")
    values: dict[str, Any] = {}
    if "classes" in table:
        classes = _typed(table["classes"], list, f"{field}.classes")
        if not classes or any(c not in DEGRADABLE for c in classes):
            raise _bad(f"{field}.classes", f"must list classes among {', '.join(DEGRADABLE)} "
                                           f"(interactive traffic is never degraded), got "
                                           f"{list(classes)!r:.80}")
        values["classes"] = tuple(sorted(set(classes)))
    if "max_tokens" in table:
        values["max_tokens"] = _typed(table["max_tokens"], int, f"{field}.max_tokens")
        if values["max_tokens"] < 1:
            raise _bad(f"{field}.max_tokens", "must be >= 1")
    if "degrade_to" in table:
        values["degrade_to"] = check_name(table["degrade_to"], f"{field}.degrade_to")
    if "max_tokens" not in values and "degrade_to" not in values:
        raise _bad(field, "needs max_tokens and/or degrade_to: what a degraded request gets")
    if "queue_fraction" in table:
        values["queue_fraction"] = _number(table["queue_fraction"], f"{field}.queue_fraction",
                                           lo=0, hi=1)
        if not 0 < values["queue_fraction"] < 1:  # at the threshold itself, shedding starts
            raise _bad(f"{field}.queue_fraction", "must be a fraction in (0, 1) of the shedding "
                                                  "threshold (--max-queued-requests)")
    if "kv_usage" in table:
        values["kv_usage"] = _number(table["kv_usage"], f"{field}.kv_usage", lo=0, hi=1)
        if values["kv_usage"] <= 0:
            raise _bad(f"{field}.kv_usage", "must be a fraction in (0, 1]")
    return DegradeConfig(**values)


def parse_route(name: str, table: Any, prefix: str = "", base: Route | None = None) -> Route:
    """A route from its table or PUT body. With `base` (the route as it is), fields left out keep
    their current value; a new route needs `weights`. `canary` = false removes the gate."""
    field = prefix.rstrip(".") or "body"
    table = _table(table, field)
    _unknown(table, _ROUTE_FIELDS, prefix)
    check_name(name, field if prefix else "route")
    if "weights" in table:
        weights = _shares(table["weights"], f"{prefix}weights", math.inf)
    elif base is not None:
        weights = base.weights
    else:
        raise _bad(f"{prefix}weights", "is required: {version: weight, ...}")
    if not any(w > 0 for _, w in weights):
        raise _bad(f"{prefix}weights", "must give at least one version a positive weight")
    sticky = table.get("sticky", base.sticky if base is not None else "none")
    if sticky not in STICKY_MODES:
        raise _bad(f"{prefix}sticky", f"must be one of {', '.join(STICKY_MODES)}, got "
                                      f"{sticky!r:.40}")
    shadow = (_shares(table["shadow"], f"{prefix}shadow", 1.0) if "shadow" in table
              else base.shadow if base is not None else ())
    canary = base.canary if base is not None else None
    if "canary" in table:
        canary = (None if table["canary"] in (None, False)
                  else _parse_canary(table["canary"], f"{prefix}canary", dict(weights)))
    elif canary is not None and dict(weights).get(canary.incumbent, 0) <= 0:
        raise _bad(f"{prefix}weights", f"leaves the canary gate's incumbent "
                                       f"{canary.incumbent!r} without traffic; change or remove "
                                       f"'canary' too")
    breaker = base.breaker if base is not None else None
    if "breaker" in table:
        breaker = (None if table["breaker"] in (None, False)
                   else _parse_breaker(table["breaker"], f"{prefix}breaker"))
    eval_gate = base.eval_gate if base is not None else None
    if "gate" in table:  # {eval = "suite.toml"}; false removes it
        eval_gate = None if table["gate"] in (None, False) else _parse_gate(table["gate"],
                                                                         f"{prefix}gate")
    degrade = base.degrade if base is not None else None
    if "degrade" in table:  # false removes it
        degrade = (None if table["degrade"] in (None, False)
                   else _parse_degrade(table["degrade"], f"{prefix}degrade"))
    return Route(name, weights, sticky, shadow, canary, breaker, eval_gate, degrade)


def _parse_gate(value: Any, field: str) -> str:
    """The eval suite (a path) whose stored results gate weight increases (docs/evals.md)."""
    table = _table(value, field)
    _unknown(table, {"eval"}, f"{field}.")
    suite = table.get("eval")
    if not isinstance(suite, str) or not suite or len(suite) > 4096:
        raise _bad(f"{field}.eval", "must be the path of an eval suite file (TOML)")
    return suite


# ---------------------------------------------------------------- the file


def parse_deployment(data: dict) -> Deployment:
    _unknown(data, {"version", "route"}, "")
    versions = _table(data.get("version", {}), "version")
    if not versions:
        raise _bad("version", "needs at least one [version.NAME] table")
    specs = tuple(parse_version(n, t, f"version.{n}.") for n, t in versions.items())
    routes = tuple(parse_route(n, t, f"route.{n}.")
                   for n, t in _table(data.get("route", {}), "route").items())
    for route in routes:
        if route.name in versions:
            raise _bad(f"route.{route.name}", "has the name of a version; clients could not "
                                              "tell which they address")
        for v, _ in route.weights + route.shadow:
            if v not in versions:
                kind = "weights" if v in dict(route.weights) else "shadow"
                raise _bad(f"route.{route.name}.{kind}.{v}", "names no [version] of this file")
        if route.degrade is not None and route.degrade.degrade_to is not None \
                and route.degrade.degrade_to not in versions:
            raise _bad(f"route.{route.name}.degrade.degrade_to", "names no [version] of this "
                                                                 "file")
    return Deployment(specs, routes)


def load_deployment(path: Path) -> Deployment:
    """Read and check a deployment file; any problem is one ConfigError naming file and field."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the deployment file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    try:
        return parse_deployment(data)
    except InvalidRequest as e:
        raise ConfigError(f"{path}: {e}") from None
