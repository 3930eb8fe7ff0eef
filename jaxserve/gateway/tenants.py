"""The tenants file (`--tenants FILE`, TOML): who may call the server, with which keys, limits and
scheduling class. Without a file there is one open tenant, `default`, with no limits.

    [tenant.acme]
    api_keys = ["sk-acme-1"]          # or api_key_sha256 = ["<64 hex>"]: the file holds no secret
    priority = "interactive"          # "interactive" > "standard" > "batch" (strict)
    weight = 4                        # share among the tenants of one class
    requests_per_minute = 600
    tokens_per_minute = 200000        # prompt + max_tokens reserved, settled at the end
    max_concurrent_requests = 32      # sequences queued + running (n > 1 counts n)
    max_queue_time_s = 30             # not started by then: refused, nothing generated
    request_timeout_s = 600           # upper bound on any request's deadline
    max_tokens_cap = 4096             # max_tokens above it: 400; the default when left out
    models = ["*"]                    # model names it may use (globs); others: 404
    kv_page_fraction = 0.5            # KV page budget: over it, its new requests wait
    policy = "strict"                 # policy pack (safety filters)
    audit_content = false             # audit records carry prompt/output text
    audit_retention_days = 30
    cache_sharing_group = "acme-org"  # prefix cache shared with tenants of the same group
    budget_usd_per_day = 50.0         # spend budgets (gateway/budgets.py): over one, 429
    budget_usd_per_month = 1000.0     #   insufficient_quota until the UTC day / month resets
    budget_alert_thresholds = [0.8, 1.0]  # shares of a budget counted (and POSTed) once crossed
    budget_webhook = "https://ops.example/budget"  # where crossings are POSTed (JSON)
    tools = ["file_search", "mcp"]    # server-side tools of /v1/responses it may use (default:
                                      #   all the server offers); another one: 403 naming it
    response_cache = false            # never answered from the response cache (default: true,
                                      #   when the server has one: serve --response-cache-size)

    [tenant.acme.code_interpreter]    # its code sandbox's limits, over the defaults
    wall_s = 10                       #   (agents/sandbox.py: SandboxLimits; docs/agents.md)
    memory_bytes = 268435456

Every value is checked where the file is read: a bad one is one ConfigError naming the file, the
tenant and the field. Plain keys are hashed (sha256) as soon as they are read and only the digests
are kept, so no key is ever in a repr, a log line or an error message.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jaxserve.errors import ConfigError, Forbidden, InvalidRequest, ModelNotFound

log = logging.getLogger("jaxserve.gateway")
MIN_KEY_CHARS = 24  # below this a key is warned of at load (review a70e490, L15)
from jaxserve.core.request import ServiceClass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # also a metrics label value
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digests: tuple[bytes, ...] = field(default=(), repr=False)  # sha256 of each API key
    priority: ServiceClass = ServiceClass.STANDARD
    weight: float = 1.0
    requests_per_minute: int | None = None  # None: no limit (every limit below alike)
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_queue_time_s: float | None = None
    request_timeout_s: float | None = None
    max_tokens_cap: int | None = None
    models: tuple[str, ...] = ("*",)
    kv_page_fraction: float | None = None
    policy: str | None = None  # None: the pack named "default"
    audit_content: bool = False
    audit_retention_days: int | None = None  # None: kept until pruned by hand
    cache_sharing_group: str | None = None  # None: its prefix cache pages are its own
    budget_usd_per_day: float | None = None  # None: no budget (gateway/budgets.py)
    budget_usd_per_month: float | None = None
    budget_alert_thresholds: tuple[float, ...] = (0.8, 1.0)
    budget_webhook: str | None = None  # an http(s) URL crossings are POSTed to
    # The code_interpreter sandbox's limits it overrides, (name, value) sorted (CODE_LIMITS).
    code_interpreter: tuple[tuple[str, float], ...] = ()
    tools: tuple[str, ...] | None = None  # server-side tools it may use; None: all (TOOL_KINDS)
    response_cache: bool = True  # its deterministic requests may be answered from the cache

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def check_model(self, model: str) -> None:
        """404 for a model the tenant may not use: its existence is not revealed."""
        if not self.may_use(model):
            raise ModelNotFound(f"The model '{model}' does not exist")

    def max_tokens(self, requested: int | None) -> int | None:
        """The max_tokens to use: the request's, at most max_tokens_cap (400 above it), or the
        cap when the request leaves it out (None: up to the context)."""
        cap = self.max_tokens_cap
        if requested is None or cap is None:
            return cap if requested is None else requested
        if requested > cap:
            raise InvalidRequest(f"max_tokens is {requested} but this API key may ask for at "
                                 f"most {cap}", "max_tokens")
        return requested

    def check_tool(self, kind: str, param: str) -> None:
        """403 naming `param` for a server-side tool the tenant may not use."""
        if self.tools is not None and kind not in self.tools:
            raise Forbidden(f"this API key may not use the tool type {kind!r} (the tenant's "
                            f"tools: {list(self.tools)})", param=param)


DEFAULT_TENANT = Tenant("default")


@dataclass(frozen=True)
class Tenants:
    """The tenants by name and by key digest; `open` when no file was given (no auth, no limits)."""

    tenants: dict[str, Tenant]
    by_digest: dict[bytes, str] = field(repr=False)
    path: Path | None = None

    @property
    def open(self) -> bool:
        return self.path is None

    def get(self, name: str) -> Tenant:
        """A tenant by name (the batch runner's --tenant)."""
        try:
            return self.tenants[name]
        except KeyError:
            raise ConfigError(f"unknown tenant {name!r}; the tenants file defines "
                              f"{', '.join(sorted(self.tenants))}") from None


def open_tenants() -> Tenants:
    return Tenants({"default": DEFAULT_TENANT}, {})


# ---- the file ----------------------------------------------------------------------------------


def load_tenants(path: str | Path) -> Tenants:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the tenants file: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    extra = set(data) - {"tenant"}
    if extra:
        raise ConfigError(f"{path}: unknown top-level field(s) {sorted(extra)}; tenants are "
                          f"[tenant.NAME] tables")
    tables = data.get("tenant")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: no tenant defined; add a [tenant.NAME] table")
    tenants: dict[str, Tenant] = {}
    by_digest: dict[bytes, str] = {}
    for name, table in tables.items():
        where = f"{path}: tenant.{name}"
        if not _NAME.match(name):
            raise ConfigError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.', '-' "
                              f"and starts with a letter or digit")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table ([tenant.{name}])")
        tenant = _tenant(name, table, where)
        for digest in tenant.key_digests:
            other = by_digest.get(digest)
            if other is not None:
                raise ConfigError(f"{where}: an API key is also a key of tenant {other!r} "
                                  f"(each key belongs to one tenant)")
            by_digest[digest] = name
        tenants[name] = tenant
    return Tenants(tenants, by_digest, path)


def _tenant(name: str, table: dict[str, Any], where: str) -> Tenant:
    unknown = set(table) - set(_FIELDS) - {"api_keys", "api_key_sha256"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: "
                          f"{sorted(set(_FIELDS) | {'api_keys', 'api_key_sha256'})}")
    keys = _strings(table.get("api_keys", []), f"{where}.api_keys")
    for i, key in enumerate(keys):
        if len(key) < MIN_KEY_CHARS:
            # key_id, in every access-log line and audit record, is a hash of the key: a short
            # key is found from the logs by hashing candidates.
            log.warning("%s.api_keys[%d]: a key of %d characters can be guessed from its key_id "
                        "in the logs; use %d or more random characters", where, i, len(key),
                        MIN_KEY_CHARS)
    digests = [hash_key(k) for k in keys]
    for i, h in enumerate(_strings(table.get("api_key_sha256", []),
                                   f"{where}.api_key_sha256")):
        if not _HEX_DIGEST.match(h):
            raise ConfigError(f"{where}.api_key_sha256[{i}]: not a sha256 hex digest "
                              f"(64 hex digits)")
        digests.append(bytes.fromhex(h))
    if not digests:
        raise ConfigError(f"{where}: no key; give api_keys or api_key_sha256")
    if len(set(digests)) != len(digests):
        raise ConfigError(f"{where}: the same API key is given twice")
    values = {f: parse(table[f], f"{where}.{f}") for f, parse in _FIELDS.items() if f in table}
    return Tenant(name, tuple(digests), **values)


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: must be a list of non-empty strings")
    return value


def _number(value: Any, where: str, *, integer: bool, low: float, low_open: bool = False,
            high: float | None = None) -> float:
    # bool is an int in Python but never a number in a config file
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ConfigError(f"{where}: must be {'an integer' if integer else 'a number'}, got "
                          f"{value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
        raise ConfigError(f"{where}: must be {bound}, got {value}")
    return value


def _positive_int(value: Any, where: str) -> int:
    return int(_number(value, where, integer=True, low=1))


def _positive(value: Any, where: str) -> float:
    return float(_number(value, where, integer=False, low=0, low_open=True))


def _fraction(value: Any, where: str) -> float:
    return float(_number(value, where, integer=False, low=0, low_open=True, high=1))


def _priority(value: Any, where: str) -> ServiceClass:
    names = [c.name.lower() for c in ServiceClass]
    if value not in names:
        raise ConfigError(f"{where}: must be one of {names}, got {value!r}")
    return ServiceClass[value.upper()]


def _globs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_strings(value, where))


def check_name(value: Any, where: str) -> str:
    """A tenant (or pack, or group) name, or ConfigError naming `where`."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(f"{where}: must be a name (1-64 letters, digits, '_', '.', '-'), got "
                          f"{value!r}")
    return value


def _thresholds(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= 16:
        raise ConfigError(f"{where}: must be a list of 1 to 16 fractions in (0, 1], got "
                          f"{value!r}")
    return tuple(sorted({_fraction(v, f"{where}[{i}]") for i, v in enumerate(value)}))


def _webhook(value: Any, where: str) -> str:
    if not isinstance(value, str) or not re.match(r"^https?://[^\s]{1,2000}$", value):
        raise ConfigError(f"{where}: must be an http:// or https:// URL")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: must be true or false, got {value!r}")
    return value


# The code sandbox's limits a tenant may set (names of agents/sandbox.py's SandboxLimits fields).
CODE_LIMITS: dict[str, Callable[[Any, str], Any]] = {
    "wall_s": _positive, "cpu_s": _positive_int, "memory_bytes": _positive_int,
    "processes": _positive_int, "file_bytes": _positive_int, "open_files": _positive_int,
    "output_bytes": _positive_int, "code_chars": _positive_int}


# The server-side tools of /v1/responses a tenant's `tools` may name.
TOOL_KINDS = ("code_interpreter", "file_search", "mcp")


def _tools(value: Any, where: str) -> tuple[str, ...]:
    unknown = sorted(set(_strings(value, where)) - set(TOOL_KINDS))
    if unknown:
        raise ConfigError(f"{where}: unknown tool type(s) {unknown}; known: {list(TOOL_KINDS)}")
    return tuple(sorted(set(value)))


def _code_limits(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a table of limits ({sorted(CODE_LIMITS)})")
    unknown = set(value) - set(CODE_LIMITS)
    if unknown:
        raise ConfigError(f"{where}: unknown limit(s) {sorted(unknown)}; known: "
                          f"{sorted(CODE_LIMITS)}")
    return tuple(sorted((k, CODE_LIMITS[k](v, f"{where}.{k}")) for k, v in value.items()))


_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "priority": _priority,
    "weight": _positive,
    "requests_per_minute": _positive_int,
    "tokens_per_minute": _positive_int,
    "max_concurrent_requests": _positive_int,
    "max_queue_time_s": _positive,
    "request_timeout_s": _positive,
    "max_tokens_cap": _positive_int,
    "models": _globs,
    "kv_page_fraction": _fraction,
    "policy": check_name,
    "audit_content": _bool,
    "audit_retention_days": _positive_int,
    "cache_sharing_group": check_name,
    "budget_usd_per_day": _positive,
    "budget_usd_per_month": _positive,
    "budget_alert_thresholds": _thresholds,
    "budget_webhook": _webhook,
    "code_interpreter": _code_limits,
    "tools": _tools,
    "response_cache": _bool,
}
